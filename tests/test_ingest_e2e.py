"""Ingest against the real broker and Postgres: counts, dead letters, crashes."""

from __future__ import annotations

import asyncio
import random
import signal
from pathlib import Path

import pytest

from flywheel.config import Settings
from flywheel.demo.samples import bad_payloads, make_trajectory
from flywheel.runtime.kafka import ensure_topics
from tests.support.helpers import dumps, produce, scalar, spawn, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]


def _stream(seed: int, good: int, bad: int) -> list[bytes]:
    rng = random.Random(seed)
    values = dumps(make_trajectory(rng, chat_format=i % 3 == 0) for i in range(good))
    values += bad_payloads(rng, bad, max_bytes=64_000)
    rng.shuffle(values)
    return values


@pytest.fixture
def ingest_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"ingest": settings.ingest.model_copy(
        update={"max_payload_bytes": 64_000, "batch_max_records": 500})})


async def test_5000_with_100_invalid(ingest_settings: Settings, pg_dsn: str, tmp_path: Path):
    s = ingest_settings
    assert s.kafka.bootstrap
    await ensure_topics(s.kafka.bootstrap, s.topics.all(), partitions=3)
    values = _stream(1, 4900, 100)
    proc = spawn("consumers.ingest", s, tmp_path / "ingest.log")
    try:
        await produce(s.kafka.bootstrap, s.topics.trajectories, values)
        rows = await wait_for(pg_dsn, "SELECT count(*) FROM trajectories", 4900)
        dead = await wait_for(pg_dsn, "SELECT count(*) FROM dead_letters", 100)
    finally:
        proc.terminate()
        proc.wait(20)
    assert (rows, dead) == (4900, 100)
    assert await scalar(pg_dsn, "SELECT count(DISTINCT trajectory_id) FROM trajectories") == 4900
    by_reason = await scalar(pg_dsn, "SELECT count(DISTINCT reason) FROM dead_letters")
    assert by_reason == 3  # not_json, schema, too_large
    assert await scalar(pg_dsn, "SELECT count(*) FROM events WHERE type = 'DeadLettered'") == 100
    ingested = await scalar(pg_dsn, "SELECT coalesce(sum((payload->>'inserted')::int), 0) "
                                    "FROM events WHERE type = 'TrajectoriesIngested'")
    assert ingested == 4900


async def test_sigkill_mid_stream_loses_and_duplicates_nothing(
    ingest_settings: Settings, pg_dsn: str, tmp_path: Path
):
    s = ingest_settings
    assert s.kafka.bootstrap
    await ensure_topics(s.kafka.bootstrap, s.topics.all(), partitions=3)
    values = _stream(2, 4950, 50)
    # Re-sent duplicates: an id-less chat record published twice must still be one row.
    rng = random.Random(7)
    twins = dumps([make_trajectory(rng, chat_format=True, with_id=False) for _ in range(20)])
    values += twins + twins
    log = tmp_path / "ingest.log"
    proc = spawn("consumers.ingest", s, log)
    producer = asyncio.create_task(produce(s.kafka.bootstrap, s.topics.trajectories, values))
    kills = 0
    try:
        for _ in range(2):
            # Kill only once the consumer is mid-stream: some rows written, not all.
            deadline = asyncio.get_running_loop().time() + 60
            start = await scalar(pg_dsn, "SELECT count(*) FROM trajectories")
            while await scalar(pg_dsn, "SELECT count(*) FROM trajectories") < start + 300:
                assert asyncio.get_running_loop().time() < deadline, log.read_text()[-2000:]
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            proc = spawn("consumers.ingest", s, log)
        await producer
        rows = await wait_for(pg_dsn, "SELECT count(*) FROM trajectories", 4970, timeout=90)
        dead = await wait_for(pg_dsn, "SELECT count(*) FROM dead_letters", 50)
    finally:
        proc.terminate()
        proc.wait(20)
    assert kills == 2
    assert rows == 4970, log.read_text()[-2000:]
    assert dead == 50
    assert await scalar(pg_dsn, "SELECT count(DISTINCT trajectory_id) FROM trajectories") == 4970
    assert await scalar(pg_dsn, "SELECT count(*) FROM events WHERE type = 'DeadLettered'") == 50
