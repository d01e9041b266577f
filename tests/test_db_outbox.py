"""Transactional outbox: an event committed but never published (crash) is published later."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.db.outbox import append_events
from flywheel.events import DeadLettered, DeadLetterPayload, parse_event
from flywheel.runtime.kafka import ensure_topics
from tests.support.helpers import scalar, spawn, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]


def _event(i: int) -> DeadLettered:
    return DeadLettered(aggregate_id=f"t/0/{i}", payload=DeadLetterPayload(
        source_topic="t", partition=0, offset=i, reason="not_json", error="bad",
        size_bytes=3, raw_preview="bad"))


async def _consume(bootstrap: str, topic: str, n: int, timeout: float = 20) -> list[bytes]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap,
                                auto_offset_reset="earliest")
    await consumer.start()
    out: list[bytes] = []
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while len(out) < n and asyncio.get_running_loop().time() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                out += [r.value for r in records if r.value is not None]
    finally:
        await consumer.stop()
    return out


async def test_crash_after_commit_before_publish(settings: Settings, db_url: str,
                                                 pg_dsn: str, tmp_path: Path) -> None:
    assert settings.kafka.bootstrap
    topic = settings.topics.trajectories_dlq
    await ensure_topics(settings.kafka.bootstrap, [topic], partitions=1)
    events = [_event(i) for i in range(5)]
    engine = make_engine(db_url)
    async with engine.begin() as conn:  # the domain transaction commits; then the "crash"
        assert await append_events(conn, events, settings.topics) == 5
    await engine.dispose()
    assert await scalar(pg_dsn, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 5

    relay = spawn("producers.relay", settings, tmp_path / "relay.log")  # the restart
    try:
        values = await _consume(settings.kafka.bootstrap, topic, 5)
        assert await wait_for(
            pg_dsn, "SELECT count(*) FROM outbox WHERE published_at IS NULL", 0) == 0
    finally:
        relay.terminate()
        relay.wait(10)
    got = [parse_event(v) for v in values]
    assert sorted(e.event_id for e in got) == sorted(e.event_id for e in events)
    assert json.loads(values[0])["type"] == "DeadLettered"


async def test_append_is_idempotent_on_event_id(settings: Settings, db_url: str,
                                                pg_dsn: str) -> None:
    engine = make_engine(db_url)
    event = _event(1)
    for _ in range(2):
        async with engine.begin() as conn:
            await append_events(conn, [event], settings.topics)
    await engine.dispose()
    assert await scalar(pg_dsn, "SELECT count(*) FROM events") == 1
    assert await scalar(pg_dsn, "SELECT count(*) FROM outbox") == 1


async def test_row_the_broker_refuses_is_parked_not_blocking(settings: Settings, db_url: str,
                                                             pg_dsn: str,
                                                             tmp_path: Path) -> None:
    assert settings.kafka.bootstrap
    topic = settings.topics.trajectories_dlq
    await ensure_topics(settings.kafka.bootstrap, [topic], partitions=1)
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        await append_events(conn, [_event(1)], settings.topics)
        from sqlalchemy import text

        # A row larger than any broker accepts, queued between two good ones.
        await conn.execute(text("INSERT INTO outbox (event_id, topic, key, value) "
                                "VALUES (gen_random_uuid(), :t, 'k', :v)"),
                           {"t": topic, "v": b"x" * (9 * 1_048_576)})
        await append_events(conn, [_event(2)], settings.topics)
    await engine.dispose()
    relay = spawn("producers.relay", settings, tmp_path / "relay.log")
    try:
        values = await _consume(settings.kafka.bootstrap, topic, 2)
        assert await wait_for(pg_dsn, "SELECT count(*) FROM outbox WHERE error IS NOT NULL",
                              1) == 1
        assert await wait_for(
            pg_dsn, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL", 2) == 2
    finally:
        relay.terminate()
        relay.wait(10)
    assert len(values) == 2
    assert await scalar(pg_dsn, "SELECT count(*) FROM outbox WHERE error LIKE '%TooLarge%'") \
        == 1
