"""The watch's running read of the trajectories' keys (`losses.KeyTail`) on the bundled broker:
what it names, what it drops once committed, and its cap, which pauses it without a gap."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from flywheel.runtime.kafka import ensure_topics
from flywheel.runtime.losses import KeyTail, candidates
from flywheel.stack.broker import LocalBroker

pytestmark = [pytest.mark.kafka]


async def produce(bootstrap: str, topic: str, keys: list[tuple[int, str | None]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=False)
    await producer.start()
    try:
        for partition, key in keys:
            await producer.send_and_wait(topic, b"{}", key=key.encode() if key else None,
                                         partition=partition)
    finally:
        await producer.stop()


def offsets(keys: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {p: [k for _, k in rows] for p, rows in keys.items()}


async def test_the_tail_names_what_is_not_committed_and_reads_on_from_where_it_was(
        broker: LocalBroker) -> None:
    topic = f"t{uuid.uuid4().hex[:10]}.trajectories"
    await ensure_topics(broker.bootstrap, [topic], partitions=2)
    await produce(broker.bootstrap, topic, [(0, f"a{i}") for i in range(6)]
                  + [(1, f"b{i}") for i in range(3)] + [(1, None)])
    tail = KeyTail(broker.bootstrap, topic, instance=1)
    try:
        # p0: 2 committed of 6; p1: none of 4 (the last keyless).
        keys = await tail.keys({0: (2, 6), 1: (0, 4)})
        assert offsets(keys) == {"0": ["a2", "a3", "a4", "a5"], "1": ["b0", "b1", "b2", None]}
        ids, counted, acked = candidates({"0": [2, 6], "1": [0, 4]}, keys)
        assert (len(ids), counted, acked) == (7, 1, 8)

        # More arrive; the round's first read takes them before the positions are read.
        await produce(broker.bootstrap, topic, [(0, "a6"), (1, "b4")])
        await tail.read()
        assert tail.held() == 4 + 4 + 2
        # Committed since: dropped; only what is behind the new positions is named.
        keys = await tail.keys({0: (5, 7), 1: (4, 5)})
        assert offsets(keys) == {"0": ["a5", "a6"], "1": ["b4"]}
        assert tail.held() == 3
        # A position past what the broker has read so far: named up to where it got.
        keys = await tail.keys({0: (7, 7), 1: (4, 5)})
        assert offsets(keys) == {"1": ["b4"]}
    finally:
        await tail.close()


async def test_the_cap_pauses_the_tail_without_a_gap(broker: LocalBroker) -> None:
    topic = f"t{uuid.uuid4().hex[:10]}.trajectories"
    await ensure_topics(broker.bootstrap, [topic], partitions=1)
    await produce(broker.bootstrap, topic, [(0, f"k{i}") for i in range(12)])
    tail = KeyTail(broker.bootstrap, topic, instance=1, cap=5)
    try:
        first = await tail.keys({0: (0, 12)})
        assert offsets(first) == {"0": [f"k{i}" for i in range(5)]}  # the rest counted
        assert candidates({"0": [0, 12]}, first)[1] == 7
        # Once ingest commits past what it holds, it reads on from offset 5, not from 12.
        later = await tail.keys({0: (4, 12)})
        assert offsets(later) == {"0": [f"k{i}" for i in range(4, 9)]}
        # Committed past where it got: it skips to the committed offset.
        await produce(broker.bootstrap, topic, [(0, f"k{i}") for i in range(12, 20)])
        assert offsets(await tail.keys({0: (14, 20)})) == {
            "0": [f"k{i}" for i in range(14, 19)]}
        last = await tail.keys({0: (18, 20)})
        assert offsets(last) == {"0": ["k18", "k19"]}
    finally:
        await tail.close()
