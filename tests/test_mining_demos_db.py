"""Demonstrations from real Postgres: mined tasks and stored successes, never holdout data."""

from __future__ import annotations

import json
from itertools import count
from typing import Any

import asyncpg
import pytest

from flywheel.config import Topics
from flywheel.db.engine import make_engine
from flywheel.demo.simulate import simulate
from flywheel.ingest import store as repo
from flywheel.ingest.wire import RawRecord, classify
from flywheel.mining import store
from flywheel.mining.build import build_task, expected_calls, split_of
from flywheel.mining.classify import classify_failure
from flywheel.mining.demos import (
    load_demonstrations,
    read_candidates,
    reserved_for_grpo,
    success_demonstration,
)
from flywheel.mining.mine_batch import mine_batch
from flywheel.tasks import TaskSpec
from flywheel.trajectory import Trajectory, parse_trajectory
from tests.test_trainer_sft import SYSTEM, corrected, record

pytestmark = [pytest.mark.postgres]


async def _ingest_and_mine(db_url: str, records: list[dict[str, Any]]) -> None:
    """What the ingest and miner consumers do with these records, minus Kafka."""
    raw = [RawRecord("t.trajectories", 0, n, None, json.dumps(r).encode())
           for n, r in enumerate(records)]
    accepted, rejected = classify(raw, max_bytes=1 << 20)
    assert not rejected
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        await repo.insert_trajectories(conn, accepted)
        await mine_batch(conn, [parse_trajectory(r) for r in records], holdout_fraction=0.2,
                         topics=Topics.for_prefix("t"))
        await store.freeze_eval_set(conn, Topics.for_prefix("t"))
    await engine.dispose()


def _held_out_failure() -> tuple[Trajectory, Trajectory]:
    """A corrected failure whose task is held out, and a success at the same request in the
    same session under another system prompt: another fingerprint, the same request."""
    for n in count():
        city = f"Town{n}"
        weather = {"city": city, "unit": "c"}
        failed = record(f"What's the weather in {city}?", [("get_weather", {"city": city}, "ok")],
                        status="failure", session="s-crafted",
                        outcome=corrected("get_weather", weather))
        found = expected_calls(failed)
        task = build_task(failed, classify_failure(failed, found[0] if found else None))
        if isinstance(task, TaskSpec) and task.split == "holdout":
            retry = failed.model_dump(mode="json", exclude_none=True)
            retry["trajectory_id"] = "00000000-0000-4000-8000-00000000c0de"
            retry["items"][0]["content"] = "You are a different bot."
            retry["items"][2]["arguments"] = json.dumps(weather)
            retry["outcome"] = {"status": "success"}
            return failed, parse_trajectory(retry)
    raise AssertionError("unreachable")


async def test_demonstrations_never_come_from_holdout_tasks(db_url: str, pg_dsn: str) -> None:
    failed, retry = _held_out_failure()
    retry_demo = success_demonstration(retry)
    assert retry_demo is not None
    assert SYSTEM not in retry_demo.messages[0]["content"]
    records = [*simulate(1500, agents=1, failure_rate=0.6, seed=3, chat_share=0.2),
               failed.model_dump(mode="json", exclude_none=True),
               retry.model_dump(mode="json", exclude_none=True)]
    await _ingest_and_mine(db_url, records)
    conn = await asyncpg.connect(pg_dsn)
    try:
        holdout_fps = {r[0] for r in await conn.fetch(
            "SELECT fingerprint FROM tasks WHERE split = 'holdout'")}
        train_fps = {r[0] for r in await conn.fetch(
            "SELECT fingerprint FROM tasks WHERE split = 'train' AND env = 'tool_call'")}
        holdout_sources = {r[0] for r in await conn.fetch("""SELECT s.trajectory_id
            FROM task_sources s JOIN tasks t USING (task_id) WHERE t.split = 'holdout'""")}
        holdout_requests = {tuple(r) for r in await conn.fetch("""
            SELECT DISTINCT f.session_id, f.request_key FROM failures f
            JOIN task_sources s ON s.trajectory_id = f.trajectory_id
            JOIN tasks t ON t.task_id = s.task_id
            WHERE t.split = 'holdout'""")}
        requests = {r[0]: (r[1], r[2]) for r in await conn.fetch("""
            SELECT trajectory_id, session_id, request_key FROM session_successes UNION ALL
            SELECT trajectory_id, session_id, request_key FROM failures""")}
        assert await conn.fetchval("SELECT count(*) FROM eval_set_tasks") == len(holdout_fps)
    finally:
        await conn.close()
    engine = make_engine(db_url)
    async with engine.connect() as c:
        demos = await load_demonstrations(c)
        again = await load_demonstrations(c)
        first = await load_demonstrations(c, limit=5)
        prospective = await load_demonstrations(c, holdout_fraction=0.2)
        left_to_grpo = await load_demonstrations(c, reserve_share=0.5)
        candidates = await read_candidates(c)
    await engine.dispose()

    # The data does hold holdout material the filter must remove: fingerprints shared with
    # holdout tasks, and the crafted same-request retry of a holdout failure.
    assert {x.demo.fingerprint for x in candidates} & holdout_fps
    assert retry_demo.fingerprint in {x.demo.fingerprint for x in candidates}
    assert (failed.session_id, requests[failed.trajectory_id][1]) in holdout_requests

    fps = {d.fingerprint for d in demos}
    sources = {d.source_trajectory_id for d in demos}
    assert not fps & holdout_fps
    assert not sources & holdout_sources
    assert not {requests[s] for s in sources if s in requests} & holdout_requests
    assert retry_demo.fingerprint not in fps and retry.trajectory_id not in sources

    # Train-side material does come through: corrected train tasks and plain successes.
    successes = {r["trajectory_id"] for r in records if r["outcome"]["status"] == "success"}
    assert fps & train_fps
    assert {str(s) for s in sources} & successes
    assert {str(s) for s in sources} - successes  # failures' corrections
    assert len({(d.fingerprint, d.completion) for d in demos}) == len(demos) > 20
    for d in demos:
        assert d.env == "tool_call" and d.reply["tool_calls"]
        for call in d.reply["tool_calls"]:
            assert call["function"]["name"] in {"get_weather", "create_ticket", "send_email"}
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert again == demos and first == demos[:5]
    # The miner's fraction also refuses what it would hold out once such a request fails.
    assert 0 < len(prospective) < len(demos)
    assert all(split_of(d.fingerprint, 0.2) == "train" for d in prospective)
    assert {d.fingerprint for d in prospective} <= fps
    # The share of fingerprints left to GRPO is not trained on, and the rest is as before.
    kept = {d.fingerprint for d in left_to_grpo}
    assert 0 < len(left_to_grpo) < len(demos)
    assert not any(reserved_for_grpo(fp, 0.5) for fp in kept)
    assert left_to_grpo == [d for d in demos if not reserved_for_grpo(d.fingerprint, 0.5)]
