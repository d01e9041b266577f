"""Several records of one subscriber in flight at once, their offsets committed in order.

A rollout worker keeps N groups sampling together (the engine batches them), so a handler
cannot settle its record before returning: it hands the record to `InFlight` and returns,
and FastStream delivers the next one. `InFlight.submit` waits while N are in flight, settles
each record as `flywheel.runtime.consume.handle` does (processed or parked, transient failures
retried), and commits a partition's offset only up to its earliest record still in flight
(`OrderedOffsets`): a crash never skips a record that was not recorded, it redelivers the
unfinished ones (idempotent for the rollout worker: a recorded group is not sampled again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from flywheel.errors import describe
from flywheel.runtime.consume import Park, Process, RetryPolicy, label, rewind, settle

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer, ConsumerRecord

log = logging.getLogger("flywheel.consume")


class OrderedOffsets:
    """Per partition, the offsets in flight and how far a commit may go."""

    def __init__(self) -> None:
        self._open: dict[TopicPartition, set[int]] = {}
        self._highest: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    def start(self, tp: TopicPartition, offset: int) -> None:
        self._open.setdefault(tp, set()).add(offset)

    def finish(self, tp: TopicPartition, offset: int) -> int | None:
        """`offset` is settled: the position to commit now (just past every settled record
        before the earliest one still open), or None when that did not move."""
        open_ = self._open.setdefault(tp, set())
        open_.discard(offset)
        self._highest[tp] = max(self._highest.get(tp, -1), offset)
        position = min(open_) if open_ else self._highest[tp] + 1
        if position <= self._committed.get(tp, -1):
            return None
        self._committed[tp] = position
        return position

    def in_flight(self) -> int:
        return sum(len(v) for v in self._open.values())


def _tp(record: ConsumerRecord[bytes, bytes]) -> TopicPartition:
    return TopicPartition(record.topic, record.partition)


class InFlight:
    """Settles up to `limit` submissions at once and commits their offsets in order."""

    def __init__(self, limit: int, process: Process, park: Park, policy: RetryPolicy, *,
                 logger: logging.Logger = log) -> None:
        self.process, self.park, self.policy, self.log = process, park, policy, logger
        self._slots = asyncio.Semaphore(limit)
        self.offsets = OrderedOffsets()
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, records: Sequence[ConsumerRecord[bytes, bytes]],
                     consumer: AIOKafkaConsumer) -> None:
        """Start settling `records` once a slot is free; returns without waiting for them."""
        await self._slots.acquire()
        for r in records:
            self.offsets.start(_tp(r), r.offset)
        task = asyncio.create_task(self._settle(list(records), consumer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle(self, records: list[ConsumerRecord[bytes, bytes]],
                      consumer: AIOKafkaConsumer) -> None:
        try:
            await settle(records, self.process, self.park, self.policy, name=label,
                         logger=self.log)
        except asyncio.CancelledError:
            raise  # left open: nothing commits past them; redelivered after a restart
        except Exception as err:
            rewind(consumer, records)  # left open, fetched again and settled then
            self.log.critical("could not settle %d records, not even park them (%s); they "
                              "are redelivered", len(records), describe(err), exc_info=err)
            await asyncio.sleep(self.policy.max_s)  # no hot loop
            return
        finally:
            self._slots.release()
        positions: dict[TopicPartition, int] = {}
        for r in records:
            position = self.offsets.finish(_tp(r), r.offset)
            if position is not None:
                positions[_tp(r)] = position
        if positions:
            try:
                await consumer.commit(positions)
            except KafkaError as err:  # partitions moved in a rebalance: the new owner
                self.log.warning("offset commit skipped (%s); redelivery is a no-op", err)

    async def close(self) -> None:
        """Stop every submission still running (they are redelivered: never committed)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
