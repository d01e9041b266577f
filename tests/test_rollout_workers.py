"""Two rollout workers (real model) share a 4-partition request topic; kill one mid-way."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.demo.simulate import simulate
from flywheel.mining.mine_batch import mine_batch
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.rollout.store import request_rollouts
from flywheel.runtime.kafka import ensure_topics
from flywheel.trajectory import parse_trajectory
from tests.support.helpers import scalar, spawn

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]
GROUPS = 12


async def test_workers_share_requests_and_survive_a_kill(settings: Settings, db_url: str,
                                                         pg_dsn: str, tmp_path: Path) -> None:
    assert settings.kafka.bootstrap
    s = settings.model_copy(update={"rollout": settings.rollout.model_copy(update={
        "group_size": 2, "max_tokens": 12, "model_dir": resolve_model_dir(None),
        "max_staleness": 1000, "rollout_timeout_s": 300})})
    await ensure_topics(s.kafka.bootstrap, [s.topics.rollout_requests], partitions=4)
    await ensure_topics(s.kafka.bootstrap, s.topics.all(), partitions=3)
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        records = simulate(600, agents=1, failure_rate=0.8, seed=12)
        await mine_batch(conn, [parse_trajectory(r) for r in records], holdout_fraction=0.0,
                         topics=s.topics)
        from sqlalchemy import text

        task_ids = list((await conn.execute(text(
            "SELECT task_id FROM tasks WHERE env = 'tool_call' ORDER BY task_id LIMIT :n"),
            {"n": GROUPS})).scalars())
        await request_rollouts(conn, task_ids, None, s.topics)
    await engine.dispose()
    assert len(task_ids) == GROUPS

    relay = spawn("producers.relay", s, tmp_path / "relay.log")
    workers = [spawn("consumers.rollout", s, tmp_path / f"worker{i}.log") for i in range(2)]
    try:
        deadline = asyncio.get_running_loop().time() + 240
        while await scalar(pg_dsn, "SELECT count(DISTINCT worker) FROM rollout_groups") < 2:
            assert asyncio.get_running_loop().time() < deadline, \
                (tmp_path / "worker0.log").read_text()[-2000:]
            await asyncio.sleep(0.2)
        done_before_kill = await scalar(pg_dsn, "SELECT count(*) FROM rollout_groups")
        assert done_before_kill < GROUPS
        workers[0].send_signal(signal.SIGKILL)
        workers[0].wait()
        while await scalar(pg_dsn, "SELECT count(*) FROM rollout_groups") < GROUPS:
            assert asyncio.get_running_loop().time() < deadline + 240, \
                (tmp_path / "worker1.log").read_text()[-2000:]
            await asyncio.sleep(0.5)
    finally:
        for p in [relay, *workers]:
            if p.poll() is None:
                p.terminate()
                p.wait(30)
    assert await scalar(pg_dsn, "SELECT count(*) FROM rollout_groups") == GROUPS
    assert await scalar(pg_dsn, "SELECT count(*) FROM rollout_requests WHERE status = 'done'") \
        == GROUPS
    # Both workers did work; the survivor finished what the killed one left.
    assert await scalar(pg_dsn, "SELECT count(DISTINCT worker) FROM rollout_groups") == 2
    assert await scalar(pg_dsn, "SELECT count(*) FROM events WHERE type = 'GroupScored'") \
        == GROUPS
