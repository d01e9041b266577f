"""Per-record isolation in the downstream consumers, wired as their services wire it (real
Postgres, records handed in directly): a record that cannot be processed is parked as that
consumer's dead letter, with its error, and everything else in its batch goes through."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from aiokafka import TopicPartition
from sqlalchemy.ext.asyncio import AsyncEngine

import consumers.miner
import consumers.rollout
from consumers.miner import feedback_handlers, miner_handlers
from consumers.rollout import rollout_handlers
from flywheel.config import Settings
from flywheel.events import (
    GroupScored,
    GroupScoredPayload,
    RolloutRequested,
    RolloutRequestedPayload,
    ScoredRollout,
)
from flywheel.ingest.wire import Accepted, RawRecord, classify_one
from flywheel.ingest.writer import store
from flywheel.runtime.consume import RetryPolicy, handle
from flywheel.trainer.learner import TrainerService

pytestmark = [pytest.mark.postgres]
FAST = RetryPolicy(initial_s=0.001, max_s=0.01, bug_attempts=3)


@dataclass
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


class Consumer:
    def __init__(self) -> None:
        self.commits: list[dict[TopicPartition, int]] = []

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(offsets)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        raise AssertionError("nothing escapes: no rewind")


def records(topic: str, values: list[bytes]) -> list[Any]:
    return [Record(topic, 0, i, None, v) for i, v in enumerate(values)]


def failure(agent: str, session: str) -> bytes:
    return json.dumps({"trajectory_id": str(uuid.uuid4()), "agent": agent, "session_id": session,
                       "items": [{"type": "message", "role": "user", "content": "refund 42"},
                                 {"type": "function_call", "call_id": "c", "name": "refund",
                                  "arguments": "{}"}],
                       "outcome": {"status": "failure"}}).encode()


async def dead_letters(dsn: str) -> list[dict[str, Any]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [dict(r) for r in await conn.fetch(
            'SELECT consumer, "offset", reason, error FROM dead_letters ORDER BY "offset"')]
    finally:
        await conn.close()


async def test_the_miner_parks_the_trajectory_it_cannot_mine_and_mines_the_rest(
        settings: Settings, engine: AsyncEngine, pg_dsn: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = consumers.miner.mine_batch

    async def mine_batch(conn: Any, batch: list[Any], **kw: Any) -> Any:
        if any(t.agent == "crashes" for t in batch):
            raise TypeError("'int' object is not iterable")  # a bug on one trajectory
        return await real(conn, batch, **kw)

    monkeypatch.setattr(consumers.miner, "mine_batch", mine_batch)
    mine, park = miner_handlers(settings, engine)
    batch = records(settings.topics.trajectories, [
        failure("a", "s1"), failure("b", "s2"), failure("crashes", "s3"), b"{not json",
        failure("c", "s4"), failure("d", "s5")])
    consumer = Consumer()
    assert await handle(batch, consumer, mine, park, FAST) == 1  # type: ignore[arg-type]
    (dead,) = await dead_letters(pg_dsn)  # the bad JSON is ingest's to dead-letter, not ours
    assert (dead["consumer"], dead["offset"], dead["reason"]) == ("miner", 2, "bug")
    assert dead["error"].startswith("TypeError: 'int' object is not iterable (at ")
    assert consumer.commits == [{TopicPartition(settings.topics.trajectories, 0): 6}]
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert sorted(await conn.fetchval("SELECT array_agg(agent) FROM failures")) == [
            "a", "b", "c", "d"]
        event = await conn.fetchrow("SELECT e.payload, o.topic FROM events e JOIN outbox o "
                                    "USING (event_id) WHERE e.type = 'RecordParked'")
    finally:
        await conn.close()
    assert event["topic"] == settings.topics.parked
    payload = json.loads(event["payload"])
    assert (payload["consumer"], payload["offset"], payload["reason"]) == ("miner", 2, "bug")


async def test_bad_feedback_is_parked_as_the_feedback_consumers_and_the_rest_applied(
        settings: Settings, engine: AsyncEngine, pg_dsn: str) -> None:
    """The feedback subscriber under the shared policy: what the feedback boundary refuses is
    parked at once (consumer `feedback`, `RecordParked` → parked topic, not the trajectories'
    DLQ), the good feedback of the same batch is stored and applied, and the whole batch is
    committed once."""
    topic = settings.topics.trajectories
    trajectory = failure("a", "s1")
    await store(engine, settings.topics, [classify_one(RawRecord(topic, 0, 0, None, trajectory),
                                                       1 << 20)], FAST)
    tid = json.loads(trajectory)["trajectory_id"]
    apply, park = feedback_handlers(settings, engine)
    feedback_topic = settings.topics.feedback
    batch = records(feedback_topic, [
        json.dumps({"trajectory_id": tid, "rating": "down", "note": "wrong amount"}).encode(),
        b"{not json",
        json.dumps({"request_id": "r-1"}).encode(),  # says nothing
        json.dumps({"request_id": "r-2", "note": "a\u0000b"}).encode(),  # unstorable
        json.dumps({"request_id": "r-3", "rating": "up",
                    "metadata": {"unknown_fields": 5}, "extra": 1}).encode(),  # wrong type
        json.dumps({"request_id": "r-4", "outcome": {"status": "failure", "reward": 1e400}})
        .encode(),
        json.dumps({"request_id": "r-5", "rating": "up"}).encode(),  # waits for r-5
    ])
    consumer = Consumer()
    assert await handle(batch, consumer, apply, park, FAST) == 0  # type: ignore[arg-type]
    assert consumer.commits == [{TopicPartition(feedback_topic, 0): 7}]
    dead = await dead_letters(pg_dsn)
    assert [(d["consumer"], d["offset"], d["reason"]) for d in dead] == [
        ("feedback", n, "permanent") for n in (1, 2, 3, 4, 5)]
    errors = [d["error"] for d in dead]
    assert errors[0].startswith("not_json: not valid JSON")
    assert "feedback says nothing" in errors[1] and "NUL character" in errors[2]
    assert "unknown_fields must be an object" in errors[3] and "NaN, Infinity" in errors[4]
    conn = await asyncpg.connect(pg_dsn)
    try:
        stored = {r[0]: r[1] for r in await conn.fetch(
            "SELECT coalesce(request_id, trajectory_id::text), applied_at IS NOT NULL "
            "FROM feedback")}
        topics = {r[0] for r in await conn.fetch(
            "SELECT o.topic FROM events e JOIN outbox o USING (event_id) "
            "WHERE e.type = 'RecordParked'")}
        status = await conn.fetchval("SELECT status FROM trajectory_outcomes")
    finally:
        await conn.close()
    assert stored == {tid: True, "r-5": False}  # r-5's trajectory is not stored yet
    assert topics == {settings.topics.parked} and status == "failure"
    again = Consumer()  # redelivery: nothing new, nothing parked twice
    assert await handle(batch, again, apply, park, FAST) == 0  # type: ignore[arg-type]
    assert len(await dead_letters(pg_dsn)) == 5


async def test_an_outage_is_retried_never_parked(settings: Settings, engine: AsyncEngine,
                                                 pg_dsn: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real, outage = consumers.miner.mine_batch, [ConnectionResetError("db restarting")] * 3

    async def mine_batch(conn: Any, batch: list[Any], **kw: Any) -> Any:
        if outage:
            raise outage.pop()
        return await real(conn, batch, **kw)

    monkeypatch.setattr(consumers.miner, "mine_batch", mine_batch)
    mine, park = miner_handlers(settings, engine)
    batch = records(settings.topics.trajectories, [failure("a", "s1"), failure("b", "s2")])
    assert await handle(batch, Consumer(), mine, park, FAST) == 0  # type: ignore[arg-type]
    assert await dead_letters(pg_dsn) == []
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM failures") == 2
    finally:
        await conn.close()


async def test_a_rollout_request_that_cannot_be_served_is_parked_and_failed(
        settings: Settings, engine: AsyncEngine, pg_dsn: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    task, request = uuid.uuid4(), uuid.uuid4()
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("""INSERT INTO tasks (task_id, fingerprint, env, failure_mode, split,
            expected_from, spec) VALUES ($1, 'fp', 'tool_call', 'wrong_tool', 'train',
            'feedback', '{}')""", task)
        await conn.execute("""INSERT INTO rollout_requests (request_id, task_id, status)
            VALUES ($1, $2, 'requested')""", request, task)
    finally:
        await conn.close()

    async def handle_request(payload: Any, **kw: Any) -> None:
        raise ValueError("the task spec does not load")  # a bug (ValueError is no verdict)

    monkeypatch.setattr(consumers.rollout, "handle_request", handle_request)
    serve, park = rollout_handlers(settings, engine, policy=None, adapters=None,  # type: ignore[arg-type]
                                   worker="w")
    event = RolloutRequested(aggregate_id=str(task), payload=RolloutRequestedPayload(
        request_id=request, task_id=task, adapter_version=None))
    topic = settings.topics.rollout_requests
    for record in records(topic, [b"\x00\x01 not an event", event.model_dump_json().encode()]):
        assert await handle([record], Consumer(), serve, park, FAST) == 1  # type: ignore[arg-type]
    garbage, bug = await dead_letters(pg_dsn)
    assert (garbage["consumer"], garbage["reason"]) == ("rollout", "permanent")
    assert "is not a flywheel event" in garbage["error"]
    assert (bug["consumer"], bug["reason"]) == ("rollout", "bug")
    assert bug["error"].startswith("ValueError: the task spec does not load (at ")
    conn = await asyncpg.connect(pg_dsn)
    try:
        status = await conn.fetchval("SELECT status FROM rollout_requests")
    finally:
        await conn.close()
    assert status == "failed"  # it no longer holds admission budget


class BrokenTrainer:
    steps = 0

    def step(self, groups: Sequence[GroupScoredPayload]) -> dict[str, float]:
        raise IndexError("index out of range in self")  # e.g. a token id past the vocabulary


def group(i: int) -> bytes:
    rollouts = [ScoredRollout(index=j, reward=float(j), reward_components={}, failure_mode=None,
                              not_run=None, turns=[], latency_ms=1.0) for j in range(2)]
    payload = GroupScoredPayload(group_id=uuid.uuid4(), task_id=uuid.uuid4(), env="tool_call",
                                 adapter=None, adapter_version=None, temperature=1.0,
                                 rollouts=rollouts, reward_mean=0.5, reward_std=0.5,
                                 trainable=True, worker="w")
    return GroupScored(aggregate_id=str(i), payload=payload).model_dump_json().encode()


async def test_the_trainer_parks_unreadable_records_and_a_step_that_fails_for_good(
        settings: Settings, engine: AsyncEngine, pg_dsn: str) -> None:
    s = settings
    service = TrainerService(s, engine)
    service.trainer = BrokenTrainer()  # type: ignore[assignment]
    b = s.rollout.train_batch_groups
    topic = s.topics.rollouts
    batch = records(topic, [b"[1, 2", *[group(i) for i in range(b)]])
    consumer = Consumer()
    await service.on_records(batch, consumer)  # type: ignore[arg-type]
    dead = await dead_letters(pg_dsn)
    assert [(d["consumer"], d["offset"], d["reason"]) for d in dead] == [
        ("trainer", 0, "permanent"), *[("trainer", i + 1, "bug") for i in range(b)]]
    assert dead[1]["error"].startswith("IndexError: index out of range in self (at ")
    assert service.batch == [] and service.status.state == "waiting"
    assert consumer.commits[-1] == {TopicPartition(topic, 0): b + 1}  # all of it is durable


async def test_ingest_turns_a_row_postgres_refuses_into_its_dead_letter(
        settings: Settings, engine: AsyncEngine, pg_dsn: str) -> None:
    """The last resort behind validation: should Postgres refuse a row validation let through,
    that record becomes an `unstorable` dead letter and the rest of its batch is stored."""
    topic = settings.topics.trajectories
    outcomes = [classify_one(RawRecord(topic, 0, i, None, failure(f"a{i}", "s")), 1 << 20)
                for i in range(8)]
    assert all(isinstance(o, Accepted) for o in outcomes)
    # jsonb refuses \u0000 in text: as if a check had missed it
    outcomes[5] = dataclasses.replace(outcomes[5], record_json='{"x": "\\u0000"}')
    await store(engine, settings.topics, outcomes, FAST)
    (dead,) = await dead_letters(pg_dsn)
    assert (dead["consumer"], dead["offset"], dead["reason"]) == ("ingest", 5, "unstorable")
    assert dead["error"].startswith("Postgres refused it (") and "validation" in dead["error"]
    conn = await asyncpg.connect(pg_dsn)
    try:
        offsets = [r[0] for r in await conn.fetch(
            "SELECT source_offset FROM trajectories ORDER BY 1")]
        assert await conn.fetchval(
            "SELECT count(*) FROM events WHERE type = 'DeadLettered'") == 1
    finally:
        await conn.close()
    assert offsets == [0, 1, 2, 3, 4, 6, 7]
