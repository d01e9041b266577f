"""What a broker fails to store is sent again, not fatal: `send_all` (the republish after a
lost broker, the gateway) and the outbox relay on UNKNOWN_SERVER_ERROR.

The bundled broker answers UNKNOWN_SERVER_ERROR (-1) to a fresh partition's first batches
for a moment; `flywheel up` after `flywheel down` while SDK clients were still sending met
exactly that in its republish, and failed.

A hole of the bundled broker these tests keep out of their way (tansu 0.6, read in its
source, not fixed here): CreateTopics registers the topic and only then resets each
partition's watermark, so a batch a producer writes in between is acknowledged and its
offsets are handed out again; a consumer then skips records (a clean-clone CI run lost one of
200). Producers that already know the topic (an SDK client across a broker restart) can hit
that window; see README, "A known hole"."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError, UnknownError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.runtime import kafka as runtime_kafka
from flywheel.runtime.kafka import ensure_topics, send_all
from flywheel.stack.broker import LocalBroker, free_port
from producers.relay import UNKNOWN_STRIKES, relay_once


class FlakyProducer:
    """Answers each value's first `fails[value]` sends with that error, then acks."""

    def __init__(self, fails: dict[bytes, list[BaseException]]) -> None:
        self.fails = {k: list(v) for k, v in fails.items()}
        self.sent: list[bytes] = []
        self.futures: list[asyncio.Future[None]] = []

    async def send(self, topic: str, value: bytes, key: bytes | None = None
                   ) -> asyncio.Future[None]:
        self.sent.append(value)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        errors = self.fails.get(value) or []
        if errors:
            future.set_exception(errors.pop(0))
        else:
            future.set_result(None)
        self.futures.append(future)
        return future


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime_kafka, "RESEND_BACKOFF_S", (0.01,))


async def test_send_all_resends_only_what_failed_until_it_is_stored() -> None:
    producer = FlakyProducer({b"b": [UnknownError(), KafkaConnectionError()],
                              b"c": [UnknownError()]})
    resent = await send_all(producer, "t", [(b"1", b"a"), (b"2", b"b"), (b"3", b"c")])  # type: ignore[arg-type]
    assert resent == 3  # b twice, c once
    assert producer.sent == [b"a", b"b", b"c", b"b", b"c", b"b"]
    assert all(f.done() for f in producer.futures)


async def test_send_all_raises_a_refusal_at_once_and_gives_up_at_its_deadline() -> None:
    refused = FlakyProducer({b"big": [MessageSizeTooLargeError()], b"x": [UnknownError()]})
    with pytest.raises(MessageSizeTooLargeError):
        await send_all(refused, "t", [(None, b"big"), (None, b"x")])  # type: ignore[arg-type]
    assert refused.sent == [b"big", b"x"]  # not sent again: the record is refused for good
    stuck = FlakyProducer({b"y": [UnknownError()] * 1000})
    with pytest.raises(UnknownError):
        await send_all(stuck, "t", [(None, b"y")], deadline_s=0.2)  # type: ignore[arg-type]
    assert 3 < len(stuck.sent) < 100


@pytest.mark.kafka
async def test_two_producers_on_a_restarted_broker_get_every_record_stored(
        services_dir: Any) -> None:
    """The race itself, on the bundled broker: an SDK-like client sends across a restart
    of the broker (so it writes the fresh instance's partitions the moment they exist)
    while `up` republishes to it. It waits out the topics' creation: writing during it is
    the broker's hole named above, not what `send_all` can mend."""
    broker = LocalBroker(free_port(), services_dir / f"race-{uuid.uuid4().hex[:6]}.log")
    topic, n = "race.trajectories", 200
    broker.start()
    try:
        await ensure_topics(broker.bootstrap, [topic], partitions=4)
        client = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all",
                                  linger_ms=5, enable_idempotence=False)
        await client.start()
        done = asyncio.Event()
        topics = asyncio.Event()  # the SDK-like client waits out the CreateTopics window
        topics.set()
        sent: list[bytes] = []
        resent = [0]

        async def sdk_like() -> None:
            i = 0
            while not done.is_set():
                await topics.wait()
                batch = [(f"sdk-{i + j}".encode(), f"sdk-{i + j}".encode()) for j in range(50)]
                try:
                    resent[0] += await send_all(client, topic, batch, deadline_s=30)
                    sent.extend(v for _, v in batch)
                except KafkaConnectionError:
                    pass  # the broker is away: this batch is not counted as sent
                i += 50
                await asyncio.sleep(0.05)

        sending = asyncio.ensure_future(sdk_like())
        try:
            await asyncio.sleep(1.0)
            topics.clear()
            await asyncio.to_thread(broker.stop)
            sent.clear()  # what the old instance held is gone with it
            await asyncio.sleep(1.0)
            await asyncio.to_thread(broker.start)
            await ensure_topics(broker.bootstrap, [topic], partitions=4)
            topics.set()  # then both write the fresh partitions' first batches at once
            republisher = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all",
                                           linger_ms=5, enable_idempotence=False)
            await republisher.start()
            try:
                mine = [(f"up-{i}".encode(), f"up-{i}".encode()) for i in range(n)]
                resent[0] += await send_all(republisher, topic, mine)
            finally:
                await republisher.stop()
            await asyncio.sleep(0.5)
        finally:
            done.set()
            await sending
            await client.stop()
        print(f"two producers on a restarted broker: {resent[0]} sends had to be resent")
        stored = await _read_all(broker.bootstrap, topic, {v for _, v in mine})
        assert {v for _, v in mine} <= stored
        assert set(sent[-50:]) <= await _read_all(broker.bootstrap, topic, set(sent[-50:]))
    finally:
        broker.stop()


async def _read_all(bootstrap: str, topic: str, want: set[bytes]) -> set[bytes]:
    """What the topic holds, read until it holds `want` (or 60 s)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=f"read-{uuid.uuid4().hex}")
    await consumer.start()
    seen: set[bytes] = set()
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(60):
                while not want <= seen:
                    for records in (await consumer.getmany(timeout_ms=500)).values():
                        seen.update(r.value for r in records if r.value is not None)
    finally:
        await consumer.stop()
    return seen


@pytest.mark.postgres
async def test_the_relay_retries_an_unknown_server_error_then_parks_the_row(
        engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        for value in (b"ok", b"flaky", b"broken"):
            await conn.execute(text("INSERT INTO outbox (event_id, topic, key, value) "
                                    "VALUES (gen_random_uuid(), 't', 'k', :v)"), {"v": value})
    producer = FlakyProducer({b"flaky": [UnknownError()],
                              b"broken": [UnknownError()] * (UNKNOWN_STRIKES + 5)})
    strikes: dict[int, int] = {}
    rounds = 0
    while True:  # each failing round is rolled back and retried, as run_relay does
        rounds += 1
        try:
            await relay_once(engine, producer, 10, strikes)  # type: ignore[arg-type]
            break
        except UnknownError:
            assert rounds < UNKNOWN_STRIKES
    async with engine.connect() as conn:
        rows = {bytes(v): (published is not None, error) for v, published, error in (
            await conn.execute(text("SELECT value, published_at, error FROM outbox"))).all()}
    assert rounds == UNKNOWN_STRIKES
    assert rows[b"ok"][0] and rows[b"flaky"][0]  # published: one resend was enough
    assert not rows[b"broken"][0] and "UnknownError" in (rows[b"broken"][1] or "")
    assert strikes == {}  # nothing left counted: published rows forget, parked ones leave


async def test_the_gateway_sends_a_request_again_when_the_bundled_broker_was_replaced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer retries what a killed instance failed on its replacement by itself, so
    every send succeeds while what the killed one acknowledged first is gone: the gateway
    compares the broker instance before the sends and after the last ack, and sends the
    whole request again to the instance that will hold it (a durable cluster is read once)."""
    from flywheel.api import publishing
    from flywheel.config import KafkaSettings, Settings

    def gateway(ids: list[str | None]) -> tuple[publishing.Publisher, FlakyProducer]:
        pub = publishing.Publisher(Settings(kafka=KafkaSettings(bootstrap="127.0.0.1:9")))
        producer = FlakyProducer({})
        pub._producer = producer  # type: ignore[assignment]
        reads = iter(ids)

        async def instance() -> str | None:
            return next(reads)

        monkeypatch.setattr(pub, "instance", instance)
        return pub, producer

    a, b = "flywheel-bundled-a", "flywheel-bundled-b"
    records = [(b"1", b"x"), (b"2", b"y")]
    pub, producer = gateway([a, b, b, b])  # replaced during the first sends
    await pub.publish("t", records)
    assert producer.sent == [b"x", b"y"] * 2
    pub, producer = gateway([a, a])
    await pub.publish("t", records)
    assert producer.sent == [b"x", b"y"]
    pub, producer = gateway(["kafkaClusterId22chars0"])  # a Kafka cluster: read once
    await pub.publish("t", records)
    await pub.publish("t", records)
    assert producer.sent == [b"x", b"y"] * 2
    pub, producer = gateway([a, b, *[f"flywheel-bundled-{i}" for i in range(1000)]])
    monkeypatch.setattr(publishing, "RESEND_WITHIN_S", 0.0)
    with pytest.raises(KafkaConnectionError, match="replaced"):
        await pub.publish("t", records)  # past its deadline: 503, the client sends again
