"""The agent SDK against the real broker: delivery, outages, spool hand-over, validation."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka import errors as kafka_errors

from flywheel.config import KafkaSettings, Settings
from flywheel.runtime.kafka import ensure_topics
from flywheel.stack.broker import LocalBroker, free_port
from flywheel.trajectory import parse_trajectory
from producers.sdk import FlywheelClient

pytestmark = [pytest.mark.kafka]


def trajectory(**over: Any) -> dict[str, Any]:
    return {"agent": "a", "outcome": {"status": "success"},
            "items": [{"type": "message", "role": "user", "content": "hi"}],
            "trajectory_id": str(uuid.uuid4()), **over}


def new_topic() -> str:
    return f"t{uuid.uuid4().hex[:10]}.trajectories"


async def consume(bootstrap: str, topic: str, expected: set[str],
                  timeout: float = 10) -> list[tuple[int, str, bytes]]:
    """(partition, key, value) in offset order per partition, until `expected` keys arrived."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    seen: list[tuple[int, str, bytes]] = []
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while not expected <= {k for _, k, _ in seen}:
            if asyncio.get_running_loop().time() > deadline:
                break
            for tp, msgs in (await consumer.getmany(timeout_ms=200)).items():
                seen += [(tp.partition, m.key.decode(), m.value) for m in msgs]
    finally:
        await consumer.stop()
    return seen


def assert_order_kept(seen: list[tuple[int, str, bytes]], logged: list[str]) -> None:
    """Each partition holds its keys in the order they were logged (first occurrence)."""
    rank = {k: i for i, k in enumerate(logged)}
    by_partition: dict[int, list[int]] = defaultdict(list)
    for partition, key, _ in seen:
        if key in rank and rank[key] not in by_partition[partition]:
            by_partition[partition].append(rank[key])
    for ranks in by_partition.values():
        assert ranks == sorted(ranks)


def spool_lines(client: FlywheelClient) -> int:
    assert client.spool_path is not None
    return client.spool_path.read_bytes().count(b"\n")


async def test_logged_trajectories_all_reach_the_topic(broker: LocalBroker,
                                                        tmp_path: Path) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    settings = Settings(home=tmp_path, kafka=KafkaSettings(bootstrap=broker.bootstrap,
                                                           topic_prefix=prefix))
    topic = settings.topics.trajectories
    await ensure_topics(broker.bootstrap, [topic], partitions=3)

    async with FlywheelClient.from_settings(settings) as client:
        ids = [str(await client.log(trajectory())) for _ in range(2000)]
        await client.flush(timeout=15)
        stats = client.stats
    assert stats["sent"] == 2000 and stats["pending"] == 0 and stats["state"] == "connected"

    seen = await consume(broker.bootstrap, topic, set(ids))
    keys = [k for _, k, _ in seen]
    assert sorted(keys) == sorted(ids)  # all of them, each once
    assert len({p for p, _, _ in seen}) == 3  # keyed by trajectory_id, so spread out
    assert_order_kept(seen, ids)
    first = parse_trajectory(json.loads(seen[0][2]))
    assert str(first.trajectory_id) == seen[0][1] and first.agent == "a"


async def test_spools_while_broker_is_down_and_delivers_when_it_is_up(tmp_path: Path) -> None:
    broker = LocalBroker(free_port(), tmp_path / "b.log")
    topic = new_topic()
    client = FlywheelClient(broker.bootstrap, topic, spool_dir=tmp_path / "spool",
                            retry_interval_s=0.2, request_timeout_ms=1000)
    try:
        await client.start()  # nothing listens yet: must not fail
        async with asyncio.timeout(2):  # and logging must not wait on the network
            ids = [str(await client.log(trajectory())) for _ in range(500)]
        assert client.stats["state"] == "spooling"
        assert client.stats["spooled"] == 500 and client.stats["pending"] == 500
        assert spool_lines(client) == 500
        with pytest.raises(TimeoutError, match="500 trajectories not acknowledged"):
            await client.flush(timeout=0.3)

        broker.start()
        await ensure_topics(broker.bootstrap, [topic], partitions=3)
        await client.flush(timeout=30)
        assert client.stats["state"] == "connected" and client.stats["spooled"] == 0
        seen = await consume(broker.bootstrap, topic, set(ids))
    finally:
        await client.close()
        broker.stop()
    assert {k for _, k, _ in seen} == set(ids)
    assert_order_kept(seen, ids)


async def test_spool_left_by_a_closed_client_is_delivered_by_the_next(broker: LocalBroker,
                                                                      tmp_path: Path) -> None:
    topic, spool_dir = new_topic(), tmp_path / "spool"
    dead = f"127.0.0.1:{free_port()}"
    first = FlywheelClient(dead, topic, spool_dir=spool_dir, retry_interval_s=0.2,
                           request_timeout_ms=1000)
    await first.start()
    ids = [str(await first.log(trajectory())) for _ in range(300)]
    await first.log_raw(b'{"replayed": true}', key=b"raw-1")
    await first.close()
    assert first.spool_path is not None
    with first.spool_path.open("ab") as f:
        f.write(b"0badc0de dG9ybg")  # a crash mid-append leaves a torn last line

    await ensure_topics(broker.bootstrap, [topic], partitions=3)
    async with FlywheelClient(broker.bootstrap, topic, spool_dir=spool_dir) as second:
        assert second.spool_path == first.spool_path
        assert second.stats["pending"] == 301  # inherited records count as logged
        later = str(await second.log(trajectory()))
        await second.flush(timeout=15)
        assert second.stats["sent"] == 302 and second.stats["spool_bytes"] == 0

    seen = await consume(broker.bootstrap, topic, {*ids, "raw-1", later})
    assert sorted(k for _, k, _ in seen) == sorted([*ids, "raw-1", later])
    assert_order_kept(seen, [*ids, "raw-1", later])  # the spool drains before newer records
    assert next(v for _, k, v in seen if k == "raw-1") == b'{"replayed": true}'


async def test_broker_restart_while_connected_loses_nothing(tmp_path: Path) -> None:
    broker = LocalBroker(free_port(), tmp_path / "b.log")
    topic = new_topic()
    broker.start()
    client = FlywheelClient(broker.bootstrap, topic, spool_dir=tmp_path / "spool",
                            max_buffered=20, max_batch=10, retry_interval_s=0.2,
                            request_timeout_ms=1000)
    try:
        await ensure_topics(broker.bootstrap, [topic], partitions=3)
        await client.start()
        for _ in range(20):
            await client.log(trajectory())
        await client.flush(timeout=5)
        assert client.stats["state"] == "connected"

        broker.stop()
        # 100 > buffer (20) + batch in flight (10): log waits until the failed send turns
        # the client to spooling, then the rest goes to disk.
        ids = [str(await client.log(trajectory())) for _ in range(100)]
        assert client.stats["state"] == "spooling"
        assert client.stats["spooled"] == 100 and spool_lines(client) == 100

        broker.start()  # memory-only: a restarted broker has no topics
        await ensure_topics(broker.bootstrap, [topic], partitions=3)
        await client.flush(timeout=30)
        seen = await consume(broker.bootstrap, topic, set(ids))
    finally:
        await client.close()
        broker.stop()
    assert set(ids) <= {k for _, k, _ in seen}
    assert_order_kept(seen, ids)


async def test_invalid_trajectory_is_refused_with_a_readable_error(tmp_path: Path) -> None:
    client = FlywheelClient(f"127.0.0.1:{free_port()}", new_topic(), spool_dir=tmp_path,
                            retry_interval_s=0.2, request_timeout_ms=1000)
    async with client:
        with pytest.raises(ValueError, match=r"invalid trajectory: agent: String should have"):
            await client.log({"agent": "", "outcome": {"status": "success"}})
        with pytest.raises(ValueError, match=r"needs what the agent did"):
            await client.log({"model": "gpt-4o"})  # no items, messages, pair or outcome
        with pytest.raises(ValueError, match=r"outcome\.status: Input should be"):
            await client.log(trajectory(outcome={"status": "meh"}))
        with pytest.raises(ValueError, match="must be a JSON object"):
            await client.log(["not", "a", "dict"])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="limit"):
            await client.log(trajectory(metadata={"blob": "x" * 1_100_000}))
        assert client.stats["pending"] == 0 and spool_lines(client) == 0


class _FlakyProducer:
    """Answers UNKNOWN_SERVER_ERROR to the first `failures` sends, then acks; keeps what
    it acked."""

    def __init__(self, failures: int, acked: list[str]) -> None:
        self.failures, self.acked = failures, acked

    async def send(self, topic: str, value: bytes, key: bytes) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.failures > 0:
            self.failures -= 1
            future.set_exception(kafka_errors.UnknownError())
        else:
            self.acked.append(key.decode())
            future.set_result(None)
        return future

    async def stop(self) -> None:
        return None


async def test_a_brokers_unknown_server_error_is_retried_not_the_end_of_delivery(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    acked: list[str] = []
    producers = iter([_FlakyProducer(3, acked), _FlakyProducer(2, acked),
                      _FlakyProducer(0, acked)])

    async def connect(self: FlywheelClient) -> _FlakyProducer:
        return next(producers)

    monkeypatch.setattr(FlywheelClient, "_connect", connect)
    # No broker to tell whether it stores (`producers.confirm`): acknowledged is delivered.
    client = FlywheelClient("127.0.0.1:1", "t.trajectories", spool_dir=tmp_path / "spool",
                            retry_interval_s=0.05, confirm=False)
    await client.start()
    try:
        ids = [str(await client.log(trajectory())) for _ in range(50)]
        await client.flush(timeout=10)
    finally:
        await client.close()
    assert set(acked) == set(ids)
    assert client.stats["rejected"] == 0
