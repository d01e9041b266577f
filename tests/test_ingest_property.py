"""Property: whatever arrives on the trajectories topic, every message ends as exactly one row
or one dead letter, through the real broker and the real ingest and miner processes.

Hypothesis generates batches mixing valid trajectories (v1 and chat transcripts) with
wrong types at every level, out-of-range timestamps and integers, NUL and lone surrogates in
any string or key, NaN/Infinity, deep nesting, huge arrays, duplicate keys, unknown fields,
arbitrary JSON and arbitrary bytes (`tests/support/trajectory_strategies.py`); the tester's records
(`tests/support/poison.py`) are a fixed example. One stack serves every example: each example is
one batch of 20-40 messages (FLYWHEEL_PROPERTY_EXAMPLES batches, default 4, plus the fixed
one: about 150 messages a run). After each batch: every consumer's lag returns to 0, no valid
record is lost or duplicated, no consumer was restarted, and the miner parked nothing (a
parked valid trajectory is a mining bug this test is meant to find).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from aiokafka import AIOKafkaProducer
from hypothesis import HealthCheck, Phase, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from flywheel.api.gateway import create_gateway_app
from flywheel.config import ApiSettings, IngestSettings, MinerSettings, RetrySettings, Settings
from flywheel.ingest.wire import Accepted, RawRecord, classify_one
from flywheel.runtime.kafka import ensure_topics, group_lag
from tests.support.helpers import spawn
from tests.support.poison import POISON
from tests.support.trajectory_strategies import Sent, sent

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

EXAMPLES = int(os.environ.get("FLYWHEEL_PROPERTY_EXAMPLES", "4"))
MAX_PAYLOAD = 64_000
TOKEN = "property-publish-token-0123"
FIXED = [Sent(f"poison: {p.name}", p.value, p.says if p.expected else "stored") for p in POISON]
CONSUMERS = ("ingest", "miner")


@dataclass
class Stack:
    settings: Settings
    dsn: str
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]]
    restarts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CONSUMERS, 0))
    sent: int = 0

    def tail(self) -> str:
        return "\n".join(f"--- {n}.log\n" + (self.logs / f"{n}.log").read_text()[-2500:]
                         for n in CONSUMERS)


@pytest.fixture
async def stack(settings: Settings, pg_dsn: str, tmp_path: Path) -> AsyncIterator[Stack]:
    s = settings.model_copy(update={
        "ingest": IngestSettings(max_payload_bytes=MAX_PAYLOAD, batch_max_records=64),
        "miner": MinerSettings(batch_max_records=32),
        "retry": RetrySettings(backoff_initial_s=0.05, backoff_max_s=0.5),
        "api": ApiSettings(tokens={TOKEN: ["publish"]}, max_request_bytes=1 << 20)})
    assert s.kafka.bootstrap
    await ensure_topics(s.kafka.bootstrap, s.topics.all(), partitions=3)
    st_ = Stack(s, pg_dsn, tmp_path, {n: spawn(f"consumers.{n}", s, tmp_path / f"{n}.log")
                                      for n in CONSUMERS})

    async def supervise() -> None:  # what a supervisor would do; the test wants none of it
        while True:
            for name, proc in st_.procs.items():
                if proc.poll() is not None:
                    st_.restarts[name] += 1
                    st_.procs[name] = spawn(f"consumers.{name}", s, tmp_path / f"{name}.log")
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(supervise())
    try:
        yield st_
    finally:
        watcher.cancel()
        for proc in st_.procs.values():
            proc.terminate()
        for proc in st_.procs.values():
            proc.wait(20)
        conn = await asyncpg.connect(pg_dsn)
        try:
            counts = [await conn.fetchval(f"SELECT count(*) FROM {t}")
                      for t in ("trajectories", "dead_letters", "failures", "tasks")]
        finally:
            await conn.close()
        print("\nproperty test: {} messages through broker, ingest and miner: {} rows, {} dead "
              "letters, {} failures mined, {} tasks".format(st_.sent, *counts))


async def produce(settings: Settings, values: list[bytes]) -> list[tuple[int, int]]:
    """Publish raw values; their (partition, offset) in order."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap, acks="all",
                                max_request_size=4 << 20)
    await producer.start()
    try:
        futures = [await producer.send(settings.topics.trajectories, v) for v in values]
        return [(m.partition, m.offset) for m in await asyncio.gather(*futures)]
    finally:
        await producer.stop()


async def settled(stack: Stack, timeout: float = 150) -> None:
    """Until every consumer group has committed everything on the topic."""
    s = stack.settings
    assert s.kafka.bootstrap
    deadline = asyncio.get_running_loop().time() + timeout
    lags: dict[str, int] = {}
    while asyncio.get_running_loop().time() < deadline:
        lags = {g: sum((await group_lag(s.kafka.bootstrap, g, s.topics.trajectories)).values())
                for g in (s.ingest.group_id, s.miner.group_id)}
        if not any(lags.values()):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"lag did not return to 0: {lags}\n{stack.tail()}")


async def _stored_at(conn: asyncpg.Connection, topic: str) -> set[tuple[int, int]]:
    """The (partition, offset) every stored trajectory row came from."""
    return {(r[0], r[1]) for r in await conn.fetch(
        "SELECT source_partition, source_offset FROM trajectories "
        "WHERE source_topic = $1 AND source_offset IS NOT NULL", topic)}


async def check_batch(stack: Stack, batch: list[Sent]) -> None:
    s = stack.settings
    topic = s.topics.trajectories
    positions = await produce(s, [m.value for m in batch])
    stack.sent += len(batch)
    # The decision each message must get: the boundary's, in-process (unit-tested on its
    # own); the family's expectation is checked on top, independently of that code.
    expected = [classify_one(RawRecord(topic, p, o, None, m.value), MAX_PAYLOAD)
                for m, (p, o) in zip(batch, positions, strict=True)]
    for m, e in zip(batch, expected, strict=True):
        if m.must == "stored":
            assert isinstance(e, Accepted), (m.family, m.value[:300], e)
        elif m.must is not None:
            assert not isinstance(e, Accepted) and m.must in e.error, (m.family, m.value[:300])
    await settled(stack)
    ids = [e.row.trajectory_id for e in expected if isinstance(e, Accepted)]
    conn = await asyncpg.connect(stack.dsn)
    try:
        rows = {r["trajectory_id"]: r for r in await conn.fetch(
            "SELECT trajectory_id, is_failure, source_partition, source_offset FROM trajectories"
            " WHERE trajectory_id = ANY($1::uuid[])", ids)}
        dead = await conn.fetch("SELECT consumer, partition, \"offset\", reason, error "
                                "FROM dead_letters WHERE topic = $1", topic)
        mined = {r[0] for r in await conn.fetch(
            "SELECT trajectory_id FROM failures WHERE trajectory_id = ANY($1::uuid[])", ids)}
        stored_at = await _stored_at(conn, topic)
    finally:
        await conn.close()
    assert not [d for d in dead if d["consumer"] != "ingest"], \
        f"the miner parked valid trajectories: {[dict(d) for d in dead]}\n{stack.tail()}"
    letters = {(d["partition"], d["offset"]): (d["reason"], d["error"]) for d in dead}
    mine = set(positions)
    for (p, o), e in zip(positions, expected, strict=True):
        if isinstance(e, Accepted):
            assert e.row.trajectory_id in rows, f"valid record lost: {e.record_json[:300]}"
            assert (p, o) not in letters
        else:
            assert letters.get((p, o)) == (e.reason, e.error), (p, o, e)
    rejected = {(p, o) for (p, o), e in zip(positions, expected, strict=True)
                if not isinstance(e, Accepted)}
    assert {pos for pos in letters if pos in mine} == rejected  # one dead letter each, no more
    # ... and nothing else: a refused message left no row (never both a row and a letter).
    assert not rejected & stored_at, f"refused yet stored: {sorted(rejected & stored_at)}"
    for tid, row in rows.items():
        if (row["source_partition"], row["source_offset"]) in mine:  # first seen here
            assert [e for (pos, e) in zip(positions, expected, strict=True)
                    if pos == (row["source_partition"], row["source_offset"])
                    and isinstance(e, Accepted) and e.row.trajectory_id == tid]
    failures = {tid for tid, row in rows.items() if row["is_failure"]}
    assert failures <= mined, f"failures the miner never mined: {failures - mined}"
    assert stack.restarts == dict.fromkeys(CONSUMERS, 0), stack.tail()


@hypothesis_settings(max_examples=EXAMPLES, deadline=None, database=None,
                     phases=[Phase.explicit, Phase.generate],  # a shrink would rerun the stack
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(sent(), min_size=20, max_size=40))
@example(batch=FIXED)
async def test_every_message_ends_as_one_row_or_one_dead_letter(stack: Stack,
                                                               batch: list[Sent]) -> None:
    await check_batch(stack, batch)


async def test_the_gateway_and_kafka_agree_on_every_fixed_example(stack: Stack) -> None:
    """Each fixed example both POSTed to the gateway and sent raw to Kafka: the same accept
    or reject, with the same reason and words (and for an accepted one, the same row)."""
    app = create_gateway_app(stack.settings)
    answers: list[httpx.Response] = []
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        for p in POISON:
            answers.append(await client.post("/v1/trajectories", content=p.value,
                                             headers={"Authorization": f"Bearer {TOKEN}"}))
    topic = stack.settings.topics.trajectories
    positions = await produce(stack.settings, [p.value for p in POISON])
    stack.sent += len(POISON)
    await settled(stack)
    conn = await asyncpg.connect(stack.dsn)
    try:
        letters = {(r["partition"], r["offset"]): (r["reason"], r["error"]) for r in
                   await conn.fetch("SELECT partition, \"offset\", reason, error FROM "
                                    "dead_letters WHERE topic = $1", topic)}
        all_ids = {str(r[0]) for r in await conn.fetch("SELECT trajectory_id FROM trajectories")}
        stored_at = await _stored_at(conn, topic)
    finally:
        await conn.close()
    status = {"schema": 422, "not_json": 400, "too_large": 413}
    for p, answer, pos in zip(POISON, answers, positions, strict=True):
        body: dict[str, Any] = answer.json()
        if pos in letters:
            reason, error = letters[pos]
            assert p.expected == reason
            assert answer.status_code == status[reason], (p.name, body)
            assert f"trajectories[0]: {error}" in body["detail"], (p.name, body, error)
            assert pos not in stored_at, f"{p.name}: refused yet stored"
        else:
            assert p.expected is None, p.name
            assert answer.status_code == 202, (p.name, body)
            (tid,) = body["trajectory_ids"]
            raw = classify_one(RawRecord(topic, *pos, None, p.value), MAX_PAYLOAD)
            assert isinstance(raw, Accepted) and str(raw.row.trajectory_id) == tid
            assert tid in all_ids  # the gateway's copy and the raw one: one row
