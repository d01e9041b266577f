"""Republishing after a lost broker instance, on real Postgres and Kafka: outbox rows
published since a group's clean time go back to the relay, stored trajectories go back to
their topic in the order they were stored, and nothing older is touched."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer

from flywheel.config import Settings
from flywheel.runtime.kafka import ensure_topics
from flywheel.stack.recovery import republish

pytestmark = [pytest.mark.postgres, pytest.mark.kafka]


async def test_republish_resends_what_the_lost_instance_may_have_held(
        settings: Settings, pg_dsn: str) -> None:
    topics = settings.topics
    await ensure_topics(settings.kafka.bootstrap or "", topics.all(), partitions=1)
    now = datetime.now(UTC)
    cut = now - timedelta(minutes=10)
    conn = await asyncpg.connect(pg_dsn)
    try:
        rows = [(topics.rollout_requests, 20), (topics.rollout_requests, 5),
                (topics.adapters, 1), (topics.adapters, 30)]  # (topic, minutes ago)
        for i, (topic, age) in enumerate(rows):
            await conn.execute("""INSERT INTO outbox (event_id, topic, key, value, published_at)
                VALUES ($1, $2, 'k', $3, $4)""", uuid.uuid4(), topic, f"e{i}".encode(),
                now - timedelta(minutes=age))
        await conn.execute("""INSERT INTO outbox (event_id, topic, key, value, published_at,
            error) VALUES ($1, $2, 'k', 'parked', $3, 'too large')""", uuid.uuid4(),
            topics.adapters, now)
        stored = []
        # (minutes ago, partition, offset): the miner had committed offset 5 of partition 0
        # and nothing of partition 1 when the broker was lost.
        for age, part, offset in ((30, 0, 9), (8, 0, 4), (7, 0, 5), (3, 1, 0), (2, 0, 6)):
            tid = uuid.uuid4()
            stored.append((age, offset >= 5 or part == 1, str(tid)))
            await conn.execute("""INSERT INTO trajectories (trajectory_id, agent, status,
                is_failure, record, ingested_at, source_topic, source_partition, source_offset)
                VALUES ($1, 'bot', 'success', false, $2, $3, $4, $5, $6)""",
                tid, json.dumps({"trajectory_id": str(tid), "agent": "bot"}),
                now - timedelta(minutes=age), topics.trajectories, part, offset)

        counts = await republish(
            settings.db.url or "", settings.kafka.bootstrap or "",
            {topics.rollout_requests: cut.timestamp(), topics.adapters: cut.timestamp(),
             topics.trajectories: cut.timestamp()}, topics.trajectories, starts={0: 5})

        assert counts == {topics.rollout_requests: 1, topics.adapters: 1, topics.trajectories: 3}
        pending = await conn.fetch("""SELECT convert_from(value, 'UTF8') AS v FROM outbox
            WHERE published_at IS NULL ORDER BY id""")
        assert [r["v"] for r in pending] == ["e1", "e2"]  # the parked row stays parked
    finally:
        await conn.close()
    consumer = AIOKafkaConsumer(topics.trajectories, bootstrap_servers=settings.kafka.bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        got: list[tuple[str, dict[str, str]]] = []
        for _ in range(20):
            for records in (await consumer.getmany(timeout_ms=500)).values():
                got += [(r.key.decode(), json.loads(r.value)) for r in records if r.key]
            if len(got) >= 3:
                break
    finally:
        await consumer.stop()
    # Stored since the cut and not committed by the miner, oldest first.
    assert [k for k, _ in got] == [tid for age, unmined, tid in stored if age < 10 and unmined]
    assert all(v["trajectory_id"] == k for k, v in got)
