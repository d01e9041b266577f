"""Mining against real Postgres: simulated trajectories → tasks, provenance, split, retries."""

from __future__ import annotations

import itertools
import uuid

import asyncpg
import pytest

from flywheel.config import Topics
from flywheel.db.engine import make_engine
from flywheel.demo.simulate import simulate
from flywheel.mining import store
from flywheel.mining.mine_batch import mine_batch
from flywheel.tasks import FAILURE_MODES
from flywheel.trajectory import parse_trajectory

pytestmark = [pytest.mark.postgres]


async def _mine(db_url: str, records: list[dict[str, object]]) -> None:
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        await mine_batch(conn, [parse_trajectory(r) for r in records], holdout_fraction=0.2,
                         topics=Topics.for_prefix("t"))
    await engine.dispose()


async def test_simulated_failures_become_tasks(db_url: str, pg_dsn: str) -> None:
    records = list(simulate(1500, agents=1, failure_rate=0.6, seed=3, chat_share=0.3))
    await _mine(db_url, records[:800])
    await _mine(db_url, records[800:])
    await _mine(db_url, records[:300])  # redelivery: a no-op
    conn = await asyncpg.connect(pg_dsn)
    try:
        failed = {r["trajectory_id"] for r in records if r["outcome"]["status"] != "success"}
        ok = {r["trajectory_id"] for r in records} - failed
        mined = {str(r[0]) for r in await conn.fetch("SELECT trajectory_id FROM failures")}
        assert mined == failed  # every failure mined once; successes never
        sources = {str(r[0]) for r in await conn.fetch("SELECT trajectory_id FROM task_sources")}
        assert not sources & ok  # successes never become tasks
        modes = {r[0] for r in await conn.fetch("SELECT DISTINCT failure_mode FROM failures")}
        assert modes == set(FAILURE_MODES)
        tasks = await conn.fetchval("SELECT count(*) FROM tasks")
        holdout = await conn.fetchval("SELECT count(*) FROM tasks WHERE split = 'holdout'")
        unverifiable = await conn.fetchval(
            "SELECT count(*) FROM failures WHERE status = 'unverifiable'")
        assert tasks > 30 and unverifiable > 10
        assert 0.1 <= holdout / tasks <= 0.3
        # Dedupe: more sources than tasks, and every task has at least one source.
        assert await conn.fetchval("SELECT count(*) FROM task_sources") > tasks
        assert await conn.fetchval("""SELECT count(*) FROM tasks t WHERE NOT EXISTS
            (SELECT 1 FROM task_sources s WHERE s.task_id = t.task_id)""") == 0
        # Retries verified some failures (expected action taken from the later success).
        assert await conn.fetchval(
            "SELECT count(*) FROM tasks WHERE expected_from LIKE 'retry:%'") > 0
        assert await conn.fetchval("SELECT count(*) FROM events WHERE type = 'TaskCreated'") \
            == tasks
    finally:
        await conn.close()


async def test_retry_arriving_after_the_failure_upgrades_it(db_url: str, pg_dsn: str) -> None:
    records = list(simulate(3000, agents=1, failure_rate=0.6, seed=5))
    pairs = [(a, b) for a, b in itertools.pairwise(records)
             if a["session_id"] == b["session_id"] and a["outcome"]["status"] == "failure"
             and b["outcome"]["status"] == "success"]
    assert pairs
    failed, retry = pairs[0]
    await _mine(db_url, [failed])
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT status FROM failures") == "unverifiable"
        await _mine(db_url, [retry])
        assert await conn.fetchval("SELECT status FROM failures") == "task"
        assert (await conn.fetchval("SELECT expected_from FROM tasks")).startswith("retry:")
    finally:
        await conn.close()


async def test_training_selection_refuses_holdout_tasks(db_url: str) -> None:
    records = list(simulate(1200, agents=1, failure_rate=0.7, seed=9))
    await _mine(db_url, records)
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        version, frozen = await store.freeze_eval_set(conn, Topics.for_prefix("t"))
        assert version == 1 and frozen > 0
        train = await store.training_tasks(conn, limit=10_000)
        assert train and all(t.split == "train" for t in train)
        holdout_id = (await conn.execute(__import__("sqlalchemy").text(
            "SELECT task_id FROM tasks WHERE split = 'holdout' LIMIT 1"))).scalar_one()
        with pytest.raises(store.HoldoutRefused):
            await store.training_tasks(conn, task_ids=[holdout_id, train[0].task_id])
        assert await store.training_tasks(conn, task_ids=[uuid.uuid4()]) == []
    await engine.dispose()


async def test_unminable_trajectories_are_skipped_not_wedging(db_url: str, pg_dsn: str) -> None:
    good = list(simulate(200, agents=1, failure_rate=0.9, seed=41))
    poison = [dict(good[0], trajectory_id=str(uuid.uuid4()))]
    poison[0]["outcome"] = {**poison[0]["outcome"], "status": "failure",
                            "feedback": '{"expected_call": {"tool": "x"}}'}
    bad_regex = dict(good[1], trajectory_id=str(uuid.uuid4()),
                     outcome={"status": "failure"})
    bad_regex["tools"] = [{"type": "function", "name": "get_weather",
                           "parameters": {"type": "object", "properties": {
                               "city": {"type": "string", "pattern": "("}}}}]
    await _mine(db_url, [*poison, bad_regex, *good])
    conn = await asyncpg.connect(pg_dsn)
    try:
        failed = {r["trajectory_id"] for r in good if r["outcome"]["status"] != "success"}
        mined = {str(r[0]) for r in await conn.fetch("SELECT trajectory_id FROM failures")}
        assert failed <= mined  # the batch went through despite the odd records
        assert poison[0]["trajectory_id"] in mined  # malformed feedback: still classified
    finally:
        await conn.close()
