"""Records in flight together: at most N at once, and a partition's offset committed only up
to its earliest record not yet settled, whatever order they finish in."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition

from flywheel.errors import Failure
from flywheel.runtime.commits import OrderedOffsets
from flywheel.runtime.consume import RetryPolicy
from flywheel.runtime.inflight import InFlight

TP = TopicPartition("requests", 0)


def test_commits_stop_at_the_earliest_open_offset() -> None:
    offsets = OrderedOffsets()
    for o in (5, 6, 7):
        offsets.start(TP, o)
    assert offsets.finish(TP, 7) == 5  # 5 still open: nothing past it
    assert offsets.finish(TP, 6) is None  # still 5
    assert offsets.finish(TP, 5) == 8  # all settled: just past the highest
    offsets.start(TP, 8)
    assert offsets.finish(TP, 8) == 9
    other = TopicPartition("requests", 1)
    offsets.start(other, 0)
    assert offsets.finish(other, 0) == 1 and offsets.in_flight() == 0


class FakeConsumer:
    def __init__(self) -> None:
        self.commits: list[dict[TopicPartition, int]] = []

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(dict(offsets))


def _record(offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord("requests", 0, offset, 0, 0, None, b"x", None, 0, 1, [])


async def test_in_flight_limit_and_ordered_commits() -> None:
    release = {o: asyncio.Event() for o in range(4)}
    running: list[int] = []
    peak = 0
    recorded: list[int] = []

    async def process(records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        nonlocal peak
        (r,) = records
        running.append(r.offset)
        peak = max(peak, len(running))
        await release[r.offset].wait()
        running.remove(r.offset)
        recorded.append(r.offset)

    async def park(record: Any, failure: Failure) -> None:
        raise AssertionError("nothing fails here")

    consumer = FakeConsumer()
    inflight = InFlight(3, process, park, RetryPolicy())
    for o in range(3):
        await inflight.submit([_record(o)], consumer)  # type: ignore[arg-type]
    fourth = asyncio.create_task(inflight.submit([_record(3)], consumer))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert sorted(running) == [0, 1, 2] and not fourth.done()  # the 4th waits for a slot

    release[2].set()  # finishes first: offset 0 is still unrecorded, so no commit passes it
    await asyncio.wait_for(fourth, 1)
    await asyncio.sleep(0.05)
    assert recorded == [2] and all(c[TP] <= 0 for c in consumer.commits)
    release[1].set()
    release[3].set()
    await asyncio.sleep(0.05)
    assert all(c[TP] <= 0 for c in consumer.commits)
    release[0].set()
    await asyncio.sleep(0.05)
    assert consumer.commits[-1] == {TP: 4} and peak == 3
    await inflight.close()


async def test_close_leaves_unfinished_records_uncommitted() -> None:
    async def process(records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        if records[0].offset == 0:
            await asyncio.sleep(60)

    async def park(record: Any, failure: Failure) -> None:
        raise AssertionError("nothing fails here")

    consumer = FakeConsumer()
    inflight = InFlight(2, process, park, RetryPolicy())
    await inflight.submit([_record(0)], consumer)  # type: ignore[arg-type]
    await inflight.submit([_record(1)], consumer)  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    await inflight.close()
    assert all(c[TP] == 0 for c in consumer.commits)  # offset 1 done, yet 0 was not
