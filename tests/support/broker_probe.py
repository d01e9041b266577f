"""Issue 38's broker probe at full size, from outside as a user's agent would run it.

Per run: a fresh stack (`flywheel up --detach`, default settings but ports and home); the SDK
built as the README shows publishes 5,000 trajectories (50 chunks of 100, 0.6 s apart); 8.2 s
in the bundled broker gets SIGINT (a graceful stop) or SIGKILL; once the supervisor replaced
it, `flywheel down` and `flywheel up --detach` while the SDK stays open, delivers the rest and
flushes. Reported per run: stored (rows in Postgres), confirmed (what the SDK counts
delivered), confirmed but not stored (at the moment `flush` returned, and at any moment of the
run: sampled every 200 ms), re-sent by the SDK, and what the lost instance's loss counted at
recovery and still counts at the end. tests/test_runtime_acked.py holds the same path as a
test, shortened.

    .venv/bin/python -m tests.support.broker_probe --signal int --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from producers.sdk import FlywheelClient
from tests.test_runtime_heal import Stack, readyz, records, stack_env


async def probe(home: Path, sig: signal.Signals, n: int, seed: int) -> dict[str, Any]:
    env = stack_env(home)
    env.pop("FLYWHEEL_STACK__WATCH_INTERVAL_S")  # the default, as a user has it
    stack = Stack(home, env)
    up = stack.cli("up", "--detach")
    assert up.returncode == 0, up.stderr
    batch = records(seed)[:n]
    ids = [uuid.UUID(r["trajectory_id"]) for r in batch]
    over: list[int] = []
    out: dict[str, Any] = {"signal": sig.name}
    try:
        run = stack.run()
        client = FlywheelClient(run["kafka_bootstrap"], run["topics"]["trajectories"],
                                spool_dir=home / "agent-spool")

        async def count() -> int:
            conn = await asyncpg.connect(stack.dsn())
            try:
                return int(await conn.fetchval("SELECT count(*) FROM trajectories WHERE "
                                               "trajectory_id = ANY($1)", ids))
            finally:
                await conn.close()

        async def watch() -> None:
            while True:
                sent = client.stats["sent"]
                try:
                    stored = await count()
                    if sent > stored:
                        over.append(sent - stored)
                except (OSError, asyncpg.PostgresError, FileNotFoundError, KeyError):
                    pass  # the stack is down or starting
                await asyncio.sleep(0.2)

        async def publish() -> None:
            for i in range(0, n, 100):
                for record in batch[i:i + 100]:
                    await client.log(record)
                await asyncio.sleep(0.6)

        async with client:
            watching = asyncio.ensure_future(watch())
            publishing = asyncio.ensure_future(publish())
            await asyncio.sleep(8.2)
            out["at_stop"] = dict(client.stats)
            os.kill(stack.run()["broker_pid"], sig)
            stopped = time.monotonic()
            await asyncio.sleep(0.5)
            while await readyz(stack) != 200:
                assert time.monotonic() - stopped < 120, "the broker was not replaced"
                await asyncio.sleep(0.3)
            for _ in range(300):  # readyz answers before the recovery has counted the loss
                losses = stack.run()["broker"]["losses"]
                if losses:
                    break
                await asyncio.sleep(0.2)
            out["loss_at_recovery"] = losses[-1]["not_stored"] if losses else "none"
            lost_id = losses[-1]["id"] if losses else None
            down = await asyncio.to_thread(stack.cli, "down")
            out["down"] = down.stderr.strip().splitlines()[-1:] if down.stderr else []
            up = await asyncio.to_thread(stack.cli, "up", "--detach")
            assert up.returncode == 0, up.stderr
            await publishing
            await client.flush(timeout=600)
            out["stored_at_flush"] = await count()
            watching.cancel()
            out["final"] = dict(client.stats)
        await asyncio.sleep(12)  # the supervisor recounts losses every 5 s
        entry = next((e for e in stack.run()["broker"]["losses"] if e["id"] == lost_id), None)
        out["loss_at_end"] = entry["not_stored"] if entry else "acked/none"
        out["stored"] = await count()
    finally:
        stack.cli("down", "--no-drain")
    final = out["final"]
    out["confirmed"] = final["sent"]
    out["confirmed_not_stored_at_flush"] = final["sent"] - out["stored_at_flush"]
    out["most_confirmed_not_stored_during_run"] = max(over, default=0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signal", choices=["int", "kill"], default="int")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--base", type=Path, default=Path("/tmp/flywheel-broker-probe"))
    args = parser.parse_args()
    sig = signal.SIGINT if args.signal == "int" else signal.SIGKILL
    for i in range(args.runs):
        home = args.base / f"{args.signal}-{i}-{uuid.uuid4().hex[:6]}"
        home.mkdir(parents=True)
        started = time.monotonic()
        result = asyncio.run(probe(home, sig, args.records, seed=1000 + i))
        result["seconds"] = round(time.monotonic() - started)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
