"""Scheduler admission control: requests never run ahead of training by more than the bound."""

from __future__ import annotations

import random
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from consumers.scheduler import schedule_once
from flywheel.config import RolloutSettings, Settings
from flywheel.db.engine import make_engine
from flywheel.demo.simulate import simulate
from flywheel.mining.mine_batch import mine_batch
from flywheel.mining.store import freeze_eval_set
from flywheel.trajectory import parse_trajectory

pytestmark = [pytest.mark.postgres]


def grpo_only(settings: Settings, **rollout: Any) -> Settings:
    """GRPO from the base model (no warm start to wait for), a budget of 2 versions × 3."""
    return settings.model_copy(update={
        "rollout": RolloutSettings(max_staleness=2, train_batch_groups=3, **rollout),
        "trainer": settings.trainer.model_copy(update={"stages": "grpo_only"})})


async def mine(conn: AsyncConnection, s: Settings, n: int, agents: int, seed: int) -> None:
    records = simulate(n, agents=agents, failure_rate=0.6, seed=seed)
    await mine_batch(conn, [parse_trajectory(r) for r in records], holdout_fraction=0.2,
                     topics=s.topics)


async def test_requests_stay_within_staleness_budget(settings: Settings, db_url: str,
                                                     pg_dsn: str) -> None:
    s = grpo_only(settings)
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        await mine(conn, s, 1500, agents=3, seed=31)
        await freeze_eval_set(conn, s.topics)
    rng = random.Random(0)
    assert await schedule_once(engine, s, rng) == 6  # budget: 2 versions × 3 groups
    assert await schedule_once(engine, s, rng) == 0  # all outstanding: nothing more
    conn = await asyncpg.connect(pg_dsn)
    try:
        # Requests only ever name train tasks, never holdout or frozen eval-set tasks.
        assert await conn.fetchval("""SELECT count(*) FROM rollout_requests r
            JOIN tasks t USING (task_id) WHERE t.split <> 'train'""") == 0
        assert await conn.fetchval("SELECT count(DISTINCT task_id) FROM rollout_requests") == 6
        assert await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE topic = $1", s.topics.rollout_requests) == 6
        # Two requests are answered with trainable groups the trainer has not consumed:
        # they still count against the budget; answered untrainable groups do not.
        await conn.execute("""UPDATE rollout_requests SET status = 'done' WHERE request_id IN
            (SELECT request_id FROM rollout_requests ORDER BY request_id LIMIT 3)""")
        await conn.execute("""INSERT INTO rollout_groups (group_id, task_id, env, scored,
               not_run, trainable, rollouts, worker, duration_ms)
            SELECT request_id, task_id, 'tool_call', 8, 0, n < 2, '[]', 'w', 1
            FROM (SELECT request_id, task_id, row_number() OVER (ORDER BY request_id) - 1 AS n
                  FROM rollout_requests WHERE status = 'done') d""")
    finally:
        await conn.close()
    assert await schedule_once(engine, s, rng) == 1  # 6 − 3 outstanding − 2 backlog
    async with engine.begin() as c:
        await c.execute(text("UPDATE rollout_groups SET trained_at = now()"))
    assert await schedule_once(engine, s, rng) == 2  # the trainer caught up
    await engine.dispose()


async def test_no_base_model_rollouts_while_the_warm_start_is_pending(
        settings: Settings, db_url: str) -> None:
    from sqlalchemy import text

    from flywheel.events import GateMetrics
    from flywheel.gate.baseline import store_baseline

    engine = make_engine(db_url)
    async with engine.begin() as conn:
        records = simulate(600, agents=1, failure_rate=0.6, seed=5)
        await mine_batch(conn, [parse_trajectory(r) for r in records], holdout_fraction=0.2,
                         topics=settings.topics)
    rng = random.Random(0)
    assert settings.trainer.stages == "sft_then_grpo"
    assert await schedule_once(engine, settings, rng) == 0  # no baseline yet

    def base(invalid: float) -> GateMetrics:
        return GateMetrics(version=None, tasks=5, samples=20, not_run=0, success_rate=0.1,
                           mean_reward=0.1, invalid_rate=invalid, unsafe_rate=0.0,
                           latency_mean_ms=1.0, latency_p95_ms=1.0, tokens_per_task=1.0,
                           groups={}, group_samples={})

    async with engine.begin() as conn:
        await store_baseline(conn, "policy", 1, base(0.9), None, settings.gate)
        await conn.execute(text("""INSERT INTO trainer_status (policy, state, updated_at)
            VALUES ('policy', 'warm_start', now())"""))
    assert await schedule_once(engine, settings, rng) == 0  # SFT under way
    async with engine.begin() as conn:  # the trainer gave up on SFT: GRPO from the base
        await conn.execute(text("UPDATE trainer_status SET state = 'waiting'"))
    assert await schedule_once(engine, settings, rng) > 0
    await engine.dispose()


async def test_a_refused_postgres_is_waited_out_not_an_exit(settings: Settings) -> None:
    """Postgres not (yet) listening: the scheduler keeps retrying until told to stop."""
    import asyncio
    import socket

    from consumers.scheduler import run_scheduler

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = settings.model_copy(update={
        "db": settings.db.model_copy(update={
            "url": f"postgresql+asyncpg://flywheel@127.0.0.1:{port}/flywheel"}),
        "retry": settings.retry.model_copy(update={"backoff_initial_s": 0.05,
                                                   "backoff_max_s": 0.1})})
    stop = asyncio.Event()
    task = asyncio.create_task(run_scheduler(cfg, stop))
    await asyncio.sleep(1.0)
    assert not task.done(), task.exception() if task.done() else None
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_rollouts_yield_to_a_gate_evaluating_on_the_same_cores(
        settings: Settings, db_url: str) -> None:
    from flywheel.gate.progress import write_status

    s = grpo_only(settings, yield_to_gate=True)
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        await mine(conn, s, 600, agents=1, seed=7)
        await write_status(conn, s.policy, state="evaluating", version=2)
    rng = random.Random(0)
    assert await schedule_once(engine, s, rng) == 0  # the gate decides first
    off = s.model_copy(update={"rollout": s.rollout.model_copy(
        update={"yield_to_gate": False})})
    assert await schedule_once(engine, off, rng) == 6  # not asked to yield: the budget
    async with engine.begin() as conn:  # a gate that stopped beating holds nothing
        await conn.execute(text("DELETE FROM rollout_requests"))
        await conn.execute(text("UPDATE gate_status SET updated_at = now() - interval '1 hour'"))
    assert await schedule_once(engine, s, rng) == 6
    await engine.dispose()
