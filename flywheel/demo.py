"""`make demo`: the main job on the embedded default, end to end as far as it exists.

Today: start the local stack; publish simulated agents' trajectories through the SDK and the
HTTP gateway (both wire formats, plus bad payloads); wait until every one is stored or
dead-lettered and every failure is mined; show the tasks that failures became (by
environment and failure mode, train/holdout, unverifiable) and freeze the eval set.
Later stages (rollouts, training, the gate) extend this.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from flywheel.config import Settings
from flywheel.samples import bad_payloads
from flywheel.simulate import simulate

console = Console()
SDK_TRAJECTORIES = 1500
GATEWAY_TRAJECTORIES = 100
BAD_PAYLOADS = 12


async def _publish(settings: Settings, run: dict[str, Any], rng: random.Random) -> None:
    from producers.sdk import FlywheelClient

    seed = rng.randrange(10**6)
    records = list(simulate(SDK_TRAJECTORIES + GATEWAY_TRAJECTORIES, agents=3,
                            failure_rate=0.3, seed=seed, chat_share=0.2))
    async with FlywheelClient.from_settings(settings) as client:
        for record in records[:SDK_TRAJECTORIES]:
            await client.log(record)
        for payload in bad_payloads(rng, BAD_PAYLOADS, max_bytes=settings.ingest.max_payload_bytes):
            await client.log_raw(payload)
        await client.flush(timeout=60)
    console.print(f"SDK: published {SDK_TRAJECTORIES} trajectories and {BAD_PAYLOADS} bad payloads")

    token = next(t for t, scopes in run["tokens"].items() if "publish" in scopes)
    batch = records[SDK_TRAJECTORIES:]
    async with httpx.AsyncClient(base_url=run["api_url"], timeout=30) as http:
        r = await http.post("/v1/trajectories", json=batch,
                            headers={"Authorization": f"Bearer {token}"})
        r.raise_for_status()
        console.print(f"gateway: POST /v1/trajectories → {r.status_code}, "
                      f"accepted {r.json()['accepted']}")
        bad = await http.post("/v1/trajectories", json={"agent": "x", "outcome": {"status": "?"}},
                              headers={"Authorization": f"Bearer {token}"})
        console.print(f"gateway: a schema error is refused up front → {bad.status_code}: "
                      f"{bad.json()['detail']}")


async def _wait(settings: Settings, expected_rows: int, expected_dlq: int,
                timeout: float = 180) -> dict[str, Any]:
    from flywheel.status import collect

    deadline = time.monotonic() + timeout
    while True:
        status = await collect(settings)
        done = (status["trajectories"] >= expected_rows and status["dlq"] >= expected_dlq
                and status["outbox_pending"] == 0
                and status["lag"][settings.ingest.group_id]["total"] == 0
                and status["lag"][settings.miner.group_id]["total"] == 0)
        if done or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.5)


ROLLOUT_GROUPS = 3


async def _rollouts(settings: Settings, want: int, timeout: float = 900) -> list[dict[str, Any]]:
    """Wait for `want` scored groups (sampled by the stack's scheduler and workers)."""
    from sqlalchemy import text

    from flywheel.db.engine import make_engine
    from flywheel.runtime.endpoints import resolve_db_url

    engine = make_engine(resolve_db_url(settings), pool_size=1)
    deadline = time.monotonic() + timeout
    try:
        while True:
            async with engine.connect() as conn:
                rows = [dict(r) for r in (await conn.execute(text("""
                    SELECT g.env, g.scored, g.not_run, g.reward_mean, g.success_rate,
                           g.trainable, g.duration_ms, t.failure_mode
                    FROM rollout_groups g JOIN tasks t USING (task_id)
                    ORDER BY g.created_at LIMIT 10"""))).mappings()]
            if len(rows) >= want or time.monotonic() > deadline:
                return rows
            await asyncio.sleep(1)
    finally:
        await engine.dispose()


def _show_groups(groups: list[dict[str, Any]]) -> None:
    table = Table(title="scored groups (base policy)")
    for col in ("env", "task failure", "scored", "not run", "mean reward", "success",
                "trainable", "seconds"):
        table.add_column(col)
    for g in groups:
        table.add_row(g["env"], g["failure_mode"], str(g["scored"]), str(g["not_run"]),
                      f"{g['reward_mean']:.2f}" if g["reward_mean"] is not None else "-",
                      f"{g['success_rate']:.2f}" if g["success_rate"] is not None else "-",
                      "yes" if g["trainable"] else
                      ("no (nothing scored)" if not g["scored"] else "no (no variance)"),
                      f"{g['duration_ms'] / 1000:.1f}")
    console.print(table)


async def _freeze(settings: Settings) -> tuple[int, int]:
    from flywheel.db.engine import make_engine
    from flywheel.mining.store import freeze_eval_set
    from flywheel.runtime.endpoints import resolve_db_url

    engine = make_engine(resolve_db_url(settings), pool_size=1)
    try:
        async with engine.begin() as conn:
            return await freeze_eval_set(conn, settings.topics.tasks)
    finally:
        await engine.dispose()


def run_demo(settings: Settings, *, keep: bool = False) -> int:
    from flywheel.runtime.stack import detach

    t0 = time.monotonic()
    console.rule("flywheel demo")
    with console.status("starting the local stack (broker, Postgres, API, consumers)…"):
        run = detach(settings)
    console.print(f"stack ready in {time.monotonic() - t0:.1f}s — api {run['api_url']}")
    before = asyncio.run(_wait(settings, 0, 0, timeout=0))
    rng = random.Random(int(time.time()))
    asyncio.run(_publish(settings, run, rng))
    with console.status("waiting until every trajectory is stored or dead-lettered…"):
        status = asyncio.run(_wait(settings, before["trajectories"] + SDK_TRAJECTORIES
                                   + GATEWAY_TRAJECTORIES, before["dlq"] + BAD_PAYLOADS))
    table = Table(title="flywheel status")
    table.add_column("what")
    table.add_column("count", justify="right")
    for key in ("trajectories", "failures", "dlq", "tasks", "tasks_holdout", "unverifiable",
                "events"):
        table.add_row(key, str(status[key]))
    for reason, n in status["dlq_by_reason"].items():
        table.add_row(f"  dlq: {reason}", str(n))
    for mode, n in status["failure_modes"].items():
        table.add_row(f"  failure: {mode}", str(n))
    for group, lag in status["lag"].items():
        table.add_row(f"lag ({group})", str(lag["total"]))
    console.print(table)
    ok = (status["trajectories"] - before["trajectories"] == SDK_TRAJECTORIES
          + GATEWAY_TRAJECTORIES and status["dlq"] - before["dlq"] == BAD_PAYLOADS
          and status["tasks"] > 0)
    version, frozen = asyncio.run(_freeze(settings))
    console.print(f"eval set v{version} frozen: {frozen} holdout tasks (training never sees "
                  "them)")
    with console.status(f"rollout workers sampling groups of {settings.rollout.group_size} "
                        "attempts from the base policy…"):
        groups = asyncio.run(_rollouts(settings, want=ROLLOUT_GROUPS))
    _show_groups(groups)
    ok = ok and len(groups) >= ROLLOUT_GROUPS
    console.print(json.dumps({"wall_s": round(time.monotonic() - t0, 1), "ok": ok}))
    if keep:
        console.print("The stack is still running (rollout workers keep sampling): try "
                      "`flywheel status`; stop it with `flywheel down`.")
    else:
        from flywheel.runtime.stack import down

        down(settings)
        console.print("Stack stopped (data kept in .flywheel/); `flywheel demo --keep` leaves "
                      "it running.")
    return 0 if ok else 1
