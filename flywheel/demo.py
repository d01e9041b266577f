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
                and all(g["total"] == 0 for g in status["lag"].values()))
        if done or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.5)


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


def run_demo(settings: Settings) -> int:
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
    console.print(json.dumps({"wall_s": round(time.monotonic() - t0, 1), "ok": ok}))
    console.print("The stack is still running: try `flywheel status`; stop it with "
                  "`flywheel down`.")
    return 0 if ok else 1
