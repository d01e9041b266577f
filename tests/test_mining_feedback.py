"""Feedback against real Postgres: order of arrival, re-mining, idempotence, counts."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.config import Topics
from flywheel.feedback import parse_feedback
from flywheel.ingest.store import insert_trajectories
from flywheel.ingest.wire import RawRecord, classify
from flywheel.mining import outcomes
from flywheel.mining.mine_batch import mine_batch
from flywheel.mining.outcomes import apply_pending, store_feedback
from flywheel.observe.status import counts
from flywheel.trajectory import parse_trajectory
from tests.support.helpers import scalar
from tests.test_formats import SECOND, SYSTEM, USER, call, pair

pytestmark = [pytest.mark.postgres]
TOPICS = Topics.for_prefix("t")
CORRECTION = [{"role": "assistant", "tool_calls": [
    {"type": "function", "function": {"name": "refund", "arguments": '{"order_id": "7"}'}}]}]


async def ingest(engine: AsyncEngine, *records: dict[str, Any]) -> None:
    """What ingest does with these records, then the miner's pass over them."""
    raws = [RawRecord("t.trajectories", 0, n, None, json.dumps(r).encode())
            for n, r in enumerate(records)]
    accepted, rejected = classify(raws, max_bytes=1 << 20)
    assert not rejected
    async with engine.begin() as conn:
        await insert_trajectories(conn, accepted)
        await mine_batch(conn, [parse_trajectory(r) for r in records], holdout_fraction=0.2,
                         topics=TOPICS)


async def feedback(engine: AsyncEngine, *records: dict[str, Any]) -> outcomes.FeedbackStats:
    """What the miner does with a batch off the feedback topic."""
    batch = [parse_feedback(r) for r in records]
    async with engine.begin() as conn:
        new = await store_feedback(conn, batch)
        return await apply_pending(conn, topics=TOPICS, holdout_fraction=0.2, only=new)


async def sweep(engine: AsyncEngine) -> outcomes.FeedbackStats:
    async with engine.begin() as conn:
        return await apply_pending(conn, topics=TOPICS, holdout_fraction=0.2)


async def status(engine: AsyncEngine) -> dict[str, Any]:
    async with engine.connect() as conn:
        return await counts(conn, "policy")  # the policy only names the gate's row


def success(session: str) -> dict[str, Any]:
    return {"agent": "bot", "session_id": session, "trajectory_id": str(uuid.uuid4()),
            "tools": SECOND["request"]["tools"], "outcome": {"status": "success"},
            "items": [{"type": "message", "role": "user", "content": "refund order 7"},
                      {"type": "function_call", "call_id": "c", "name": "refund",
                       "arguments": '{"order_id": "7"}'}]}


async def test_feedback_that_comes_first_waits_for_its_trajectory(engine: AsyncEngine,
                                                                  pg_dsn: str) -> None:
    down = {"request_id": "chatcmpl-9", "rating": "down", "correction": CORRECTION}
    early = await feedback(engine, down)
    assert (early.applied, (await status(engine))["feedback_pending"]) == (0, 1)
    await ingest(engine, SECOND)
    before = await status(engine)
    assert (before["awaiting_outcome"], before["failures"], before["tasks"]) == (1, 0, 0)
    applied = await sweep(engine)
    assert (applied.applied, applied.mined.failures, applied.mined.tasks_created) == (1, 1, 1)
    after = await status(engine)
    assert (after["awaiting_outcome"], after["failures"], after["tasks"], after["feedback"],
            after["feedback_applied"], after["feedback_pending"]) == (0, 1, 1, 1, 1, 0)
    assert await scalar(pg_dsn, "SELECT count(*) FROM tasks WHERE expected_from = "
                                "'human_correction'") == 1
    assert await scalar(pg_dsn, "SELECT count(*) FROM events WHERE type = 'FeedbackReceived' "
                                "AND payload->>'status' = 'failure' AND "
                                "payload->>'previous_status' = 'awaiting_outcome'") == 1
    # Re-sent feedback and a redelivered trajectory change nothing.
    again = await feedback(engine, down)
    await ingest(engine, SECOND)
    assert again.applied == 0 and (await sweep(engine)).applied == 0
    assert await status(engine) == after


async def test_a_thumbs_down_on_a_success_takes_it_back_as_a_retry(engine: AsyncEngine,
                                                                   pg_dsn: str) -> None:
    ok = success("s-1")
    await ingest(engine, ok)
    assert await scalar(pg_dsn, "SELECT count(*) FROM session_successes") == 1
    stats = await feedback(engine, {"trajectory_id": ok["trajectory_id"], "rating": "down"})
    assert (stats.applied, stats.mined.failures, stats.mined.unverifiable) == (1, 1, 1)
    assert await scalar(pg_dsn, "SELECT count(*) FROM session_successes") == 0
    await ingest(engine, ok)  # the record redelivered as it was logged: feedback still wins
    assert await scalar(pg_dsn, "SELECT count(*) FROM session_successes") == 0
    s = await status(engine)
    assert (s["failures"], s["unverifiable"]) == (1, 1)
    # A thumbs-up after all: the failure is overturned and the success counts again.
    await feedback(engine, {"trajectory_id": ok["trajectory_id"], "rating": "up"})
    s = await status(engine)
    assert (s["failures"], s["unverifiable"]) == (0, 0)
    assert await scalar(pg_dsn, "SELECT count(*) FROM session_successes") == 1
    assert await scalar(pg_dsn, "SELECT feedback_count FROM trajectory_outcomes") == 2


async def test_feedback_that_cannot_be_applied_is_parked_not_retried(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    await ingest(engine, SECOND)

    async def broken(*_args: object, **_kw: object) -> None:
        raise RuntimeError("mining exploded")

    monkeypatch.setattr(outcomes, "remine", broken)
    stats = await feedback(engine, {"request_id": "chatcmpl-9", "rating": "down"})
    assert (stats.applied, stats.parked) == (0, 1)
    s = await status(engine)
    assert (s["feedback_parked"], s["feedback_pending"], s["awaiting_outcome"]) == (1, 0, 1)
    assert (await sweep(engine)).parked == 0  # parked stays parked: no retry loop


async def test_across_pairs_a_new_attempt_is_a_retry_a_continuation_is_not(
        engine: AsyncEngine, pg_dsn: str) -> None:
    def answered(n: int, messages: list[dict[str, Any]], name: str) -> dict[str, Any]:
        record = pair(messages, {"role": "assistant", "content": None,
                                 "tool_calls": [call(name, {"order_id": "7"})]})
        record["response"] = {**record["response"], "id": f"chatcmpl-{n}"}
        return record

    wrong = answered(1, [SYSTEM, USER], "cancel_order")
    goes_on = answered(2, [SYSTEM, USER, wrong["response"]["choices"][0]["message"],
                           {"role": "tool", "tool_call_id": "call_2_0", "content": "cancelled"}],
                       "get_order")
    again = answered(3, [SYSTEM, USER], "refund")  # a new conversation, same opening
    await ingest(engine, wrong, goes_on, again)
    await feedback(engine, {"request_id": "chatcmpl-1", "rating": "down"})
    assert await scalar(pg_dsn, "SELECT count(*) FROM failures WHERE status = "
                                "'unverifiable'") == 1
    later = await feedback(engine, {"request_id": "chatcmpl-2", "rating": "up"})
    assert later.mined.upgraded == 0  # the same conversation going on: no retry
    retry = await feedback(engine, {"request_id": "chatcmpl-3", "rating": "up"})
    assert retry.mined.upgraded == 1
    spec = json.loads(str(await scalar_text(pg_dsn, "SELECT spec::text FROM tasks")))
    assert [c["name"] for c in spec["verifier"]["expected"]] == ["refund"]
    assert await scalar(pg_dsn, "SELECT count(*) FROM tasks WHERE expected_from LIKE "
                                "'retry:%'") == 1


async def scalar_text(dsn: str, sql: str) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()
