"""End to end on the real broker + Postgres: simulated agents → ingest + miner → tasks."""

from __future__ import annotations

import json
from pathlib import Path

import asyncpg
import pytest

from flywheel.config import Settings
from flywheel.demo.simulate import simulate
from flywheel.observe.status import collect
from flywheel.runtime.kafka import ensure_topics
from tests.support.helpers import produce, scalar, spawn, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]


async def test_simulated_agents_become_tasks(settings: Settings, pg_dsn: str,
                                             tmp_path: Path) -> None:
    assert settings.kafka.bootstrap
    await ensure_topics(settings.kafka.bootstrap, settings.topics.all(), partitions=3)
    records = list(simulate(2000, agents=3, failure_rate=0.3, seed=21, chat_share=0.2))
    failed = sum(r["outcome"]["status"] != "success" for r in records)
    procs = [spawn("consumers.ingest", settings, tmp_path / "ingest.log"),
             spawn("consumers.miner", settings, tmp_path / "miner.log"),
             spawn("producers.relay", settings, tmp_path / "relay.log")]
    try:
        await produce(settings.kafka.bootstrap, settings.topics.trajectories,
                      [json.dumps(r).encode() for r in records])
        assert await wait_for(pg_dsn, "SELECT count(*) FROM failures", failed, 120) == failed, \
            (tmp_path / "miner.log").read_text()[-3000:]
        await wait_for(pg_dsn, "SELECT count(*) FROM trajectories", len(records))
        await wait_for(pg_dsn, "SELECT count(*) FROM outbox WHERE published_at IS NULL", 0)
        status = await collect(settings)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)
    assert status["trajectories"] == len(records)
    assert status["failures"] == failed
    assert status["tasks"] > 0 and status["unverifiable"] > 0
    assert 0.1 <= status["tasks_holdout"] / status["tasks"] <= 0.3
    assert status["lag"]["flywheel-miner"]["total"] == 0
    assert await _envs(pg_dsn) == "code,tool_call,workplace"
    # Each task is linked to its sources, which are failed trajectories we published.
    assert await scalar(pg_dsn, """SELECT count(*) FROM task_sources s
        JOIN trajectories t ON t.trajectory_id = s.trajectory_id WHERE t.is_failure""") == \
        await scalar(pg_dsn, "SELECT count(*) FROM task_sources")


async def _envs(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        return str(await conn.fetchval(
            "SELECT string_agg(DISTINCT env, ',' ORDER BY env) FROM tasks"))
    finally:
        await conn.close()
