"""A record is confirmed stored only by the broker instance that acknowledged it.

The SDK against a scripted Kafka (`FakeKafka`: broker instances at one address, each with its
own log and its storing group's committed offset), so that a replacement lands exactly where
a real one can: between the acknowledgements of one batch (aiokafka retries a request the
dying broker never answered on the next one), or between two reads of one poll. The real
broker, a real stack and the graceful stop are in tests/test_runtime_acked.py."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

import producers.confirm as confirm_module
from flywheel.runtime.kafka import BUNDLED_CLUSTER_PREFIX, is_bundled
from producers.sdk import FlywheelClient
from tests.test_producers_sdk import trajectory


class Instance:
    def __init__(self, name: str) -> None:
        self.cluster_id = name
        self.log: list[bytes] = []
        self.committed = -1
        """The storing group's committed offset (one partition): what it stored."""

    def stored(self) -> set[bytes]:
        return set(self.log[:max(0, self.committed)])


class FakeKafka:
    """Broker instances replacing one another at one address."""

    def __init__(self) -> None:
        self.instances = [Instance(f"{BUNDLED_CLUSTER_PREFIX}a")]
        self.held: list[tuple[bytes, asyncio.Future[Any]]] = []
        self.hold_after: int | None = None
        """Acknowledge this many more sends at once, then hold the rest until `release`."""
        self.replace_after_describe: Instance | None = None
        """Replaced by this instance right after the next Metadata answer."""

    @property
    def current(self) -> Instance:
        return self.instances[-1]

    def replace(self, instance: Instance | None = None) -> Instance:
        name = f"{BUNDLED_CLUSTER_PREFIX}{len(self.instances)}"
        self.instances.append(instance or Instance(name))
        return self.current

    def append(self, key: bytes) -> SimpleNamespace:
        self.current.log.append(key)
        return SimpleNamespace(partition=0, offset=len(self.current.log) - 1)

    def release(self) -> None:
        """The held sends are answered by whichever instance runs now (aiokafka's retry)."""
        for key, future in self.held:
            future.set_result(self.append(key))
        self.held, self.hold_after = [], None

    def stored(self) -> set[bytes]:
        return set().union(*(i.stored() for i in self.instances))


class FakeProducer:
    def __init__(self, kafka: FakeKafka) -> None:
        self.kafka = kafka

    async def send(self, topic: str, value: bytes, key: bytes) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        k = self.kafka
        if k.hold_after is not None and k.hold_after <= 0:
            k.held.append((key, future))
            return future
        if k.hold_after is not None:
            k.hold_after -= 1
        future.set_result(k.append(key))
        return future

    async def stop(self) -> None:
        return None


def fake_admin(kafka: FakeKafka) -> type:
    class FakeAdmin:
        def __init__(self, **_: Any) -> None:
            pass

        async def start(self) -> None:
            return None

        async def close(self) -> None:
            return None

        async def describe_cluster(self) -> dict[str, Any]:
            answer = {"cluster_id": kafka.current.cluster_id}
            successor, kafka.replace_after_describe = kafka.replace_after_describe, None
            if successor is not None:  # the broker is replaced right after answering
                kafka.replace(successor)
            return answer

        async def list_consumer_group_offsets(self, group: str, partitions: list[TopicPartition]
                                              ) -> dict[TopicPartition, OffsetAndMetadata]:
            return {tp: OffsetAndMetadata(kafka.current.committed, "") for tp in partitions}

    return FakeAdmin


@pytest.fixture
def kafka(monkeypatch: pytest.MonkeyPatch) -> FakeKafka:
    k = FakeKafka()

    async def connect(self: FlywheelClient) -> FakeProducer:
        return FakeProducer(k)

    monkeypatch.setattr(FlywheelClient, "_connect", connect)
    monkeypatch.setattr(confirm_module, "AIOKafkaAdminClient", fake_admin(k))
    return k


def client(tmp_path: Path) -> FlywheelClient:
    return FlywheelClient("127.0.0.1:1", "t.trajectories", spool_dir=tmp_path / "spool",
                          confirm_group="flywheel-ingest", max_batch=10, linger_ms=1,
                          retry_interval_s=0.02, confirm_interval_s=0.01)


async def until(check: Any, timeout: float = 5) -> None:
    for _ in range(int(timeout / 0.005)):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("not in time")


async def store_current(kafka: FakeKafka) -> None:
    """The storing group on whichever instance runs: it stores everything it reads."""
    while True:
        kafka.current.committed = len(kafka.current.log)
        await asyncio.sleep(0.005)


async def test_a_batch_acknowledged_across_a_replacement_is_sent_again(
        kafka: FakeKafka, tmp_path: Path) -> None:
    """The first half of a batch is acknowledged by instance A, A is replaced by B, the
    rest by B; meanwhile the confirmer saw B. A's half must not be judged by B's offsets."""
    c = client(tmp_path)
    await c.start()
    storing: asyncio.Task[None] | None = None
    try:
        first = [str(await c.log(trajectory())).encode() for _ in range(10)]
        await until(lambda: c.stats["unconfirmed"] == 10)  # acknowledged by A, A stores nothing
        kafka.hold_after = 5
        second = [str(await c.log(trajectory())).encode() for _ in range(10)]
        await until(lambda: len(kafka.held) == 5)
        kafka.replace()
        await until(lambda: c.stats["resent"] >= 10)  # the confirmer saw B: `first` again
        kafka.release()  # the rest of the batch acknowledged by B
        storing = asyncio.create_task(store_current(kafka))
        await c.flush(timeout=5)
        missing = set(first + second) - kafka.stored()
        assert not missing, f"{len(missing)} records confirmed but never stored"
    finally:
        if storing is not None:
            storing.cancel()
        await c.close(timeout=1)


async def test_offsets_read_from_a_replacement_confirm_nothing_of_its_predecessor(
        kafka: FakeKafka, tmp_path: Path) -> None:
    """A is replaced between the reads of one poll by B, whose storing group is already
    past A's offsets (it stored what was republished to it): A's records are not stored."""
    c = client(tmp_path)
    await c.start()
    b = Instance(f"{BUNDLED_CLUSTER_PREFIX}b")
    b.log = [uuid.uuid4().bytes for _ in range(50)]  # republished to it, and stored
    b.committed = 50
    storing: asyncio.Task[None] | None = None
    try:
        ids = [str(await c.log(trajectory())).encode() for _ in range(10)]
        await until(lambda: c.stats["unconfirmed"] == 10)
        kafka.replace_after_describe = b
        await until(lambda: len(kafka.instances) == 2)
        storing = asyncio.create_task(store_current(kafka))
        await c.flush(timeout=5)
        missing = set(ids) - kafka.stored()
        assert not missing, f"{len(missing)} records confirmed but never stored"
        assert c.stats["resent"] == 10
    finally:
        if storing is not None:
            storing.cancel()
        await c.close(timeout=1)
    assert set(ids) <= set(b.log)


def test_a_bundled_broker_is_told_by_its_cluster_id() -> None:
    assert is_bundled(f"{BUNDLED_CLUSTER_PREFIX}0123456789abcdef")
    assert not is_bundled("MkU3OEVBNTcwNTJENDM2Qk")  # a Kafka cluster's id (a base64 UUID)
    assert not is_bundled(None)
