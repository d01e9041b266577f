"""Acknowledged means stored (`producers.confirm`): against the real broker, with a storing
group played by a consumer that commits what it read (as ingest does after its transaction).
Clients are built as the README shows (no confirmation setting): the broker decides."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer

from flywheel.config import KafkaSettings, Settings
from flywheel.runtime.kafka import ensure_topics
from flywheel.stack.broker import LocalBroker, free_port
from producers.feedback_client import FeedbackClient
from producers.sdk import FlywheelClient
from tests.test_producers_sdk import consume, trajectory

pytestmark = [pytest.mark.kafka]


async def store_and_commit(bootstrap: str, topic: str, group: str, want: int) -> set[str]:
    """Read `want` records as group `group` and commit them: the keys it 'stored'."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group,
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                session_timeout_ms=6000, heartbeat_interval_ms=1000)
    await consumer.start()
    keys: set[str] = set()
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while len(keys) < want and asyncio.get_running_loop().time() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            keys |= {m.key.decode() for msgs in batch.values() for m in msgs}
            if batch:
                await consumer.commit()
    finally:
        await consumer.stop()
    return keys


async def test_the_default_follows_the_broker(tmp_path: Path, broker: LocalBroker) -> None:
    """Any broker but a bundled one: acknowledged is delivered, unless the setting says
    otherwise (`kafka.confirm_stored`, whichever way)."""
    topic = f"t{uuid.uuid4().hex[:8]}.trajectories"
    await ensure_topics(broker.bootstrap, [topic], partitions=1)
    async with FlywheelClient(broker.bootstrap, topic, spool_dir=tmp_path / "a") as client:
        await client.log(trajectory())
        await client.flush(timeout=10)
        assert not client.stats["confirming"]
    settings = Settings(home=tmp_path, kafka=KafkaSettings(
        bootstrap=broker.bootstrap, topic_prefix=topic.split(".")[0], confirm_stored=True))
    await ensure_topics(broker.bootstrap, [settings.topics.feedback], partitions=1)
    for forced in (FlywheelClient.from_settings(settings), FeedbackClient.from_settings(settings)):
        await forced.start()
        await forced.log_raw(b"{}", key=b"k")
        with pytest.raises(TimeoutError):  # no one stores it
            await forced.flush(timeout=1)
        assert forced.stats["unconfirmed"] == 1
        await forced.close(timeout=0.2)


async def test_flush_waits_until_stored_and_a_replaced_broker_gets_them_again(
        tmp_path: Path) -> None:
    broker = LocalBroker(free_port(), tmp_path / "b.log", bundled=True)
    topic, group = f"t{uuid.uuid4().hex[:8]}.trajectories", Settings().ingest.group_id
    broker.start()
    client = FlywheelClient(broker.bootstrap, topic, spool_dir=tmp_path / "spool",
                            retry_interval_s=0.2, request_timeout_ms=1000)
    try:
        await ensure_topics(broker.bootstrap, [topic], partitions=3)
        await client.start()
        ids = [str(await client.log(trajectory())) for _ in range(300)]
        with pytest.raises(TimeoutError):  # acknowledged by the broker, stored by no one
            await client.flush(timeout=2)
        assert client.stats["unconfirmed"] == 300
        stored = asyncio.create_task(store_and_commit(broker.bootstrap, topic, group, 300))
        await client.flush(timeout=60)
        assert set(ids) <= await stored and client.stats["unconfirmed"] == 0

        # Acknowledged, not stored, and the (memory-only) broker dies: a new one gets them.
        lost = [str(await client.log(trajectory())) for _ in range(200)]
        await asyncio.sleep(1)
        assert client.stats["unconfirmed"] == 200
        broker.stop()
        broker.start()
        await ensure_topics(broker.bootstrap, [topic], partitions=3)
        seen = await consume(broker.bootstrap, topic, set(lost), timeout=30)
        assert set(lost) <= {k for _, k, _ in seen}
        assert client.stats["resent"] == 200
        assert set(lost) <= await store_and_commit(broker.bootstrap, topic, group, 200)
        await client.flush(timeout=30)
    finally:
        await client.close(timeout=5)
        broker.stop()


async def test_close_keeps_what_was_not_stored_in_the_spool(tmp_path: Path,
                                                            broker: LocalBroker) -> None:
    topic = f"t{uuid.uuid4().hex[:8]}.trajectories"
    await ensure_topics(broker.bootstrap, [topic], partitions=3)
    kw: dict[str, Any] = {"spool_dir": tmp_path / "spool", "confirm": True,
                          "confirm_group": "nobody"}
    async with FlywheelClient(broker.bootstrap, topic, **kw) as client:
        for _ in range(50):
            await client.log(trajectory())
        await asyncio.sleep(0.5)
        await client.close(timeout=1)  # no one stores them: they go back to the spool
    async with FlywheelClient(broker.bootstrap, topic, **kw) as again:
        assert again.stats["pending"] == 50  # the next client re-sends them
        await again.close(timeout=1)
