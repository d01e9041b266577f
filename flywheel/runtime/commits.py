"""Ordered offset commits: the one way every consumer commits what it has settled.

A consumer `open`s records when it takes them on and calls `settled` once their effects
(rows, or dead letters) are durable. Per partition the commit goes just past every settled
record before the earliest one still open, and never backwards: a crash never skips a
record that was not recorded, it redelivers the unfinished ones (redelivery is a no-op for
every consumer: each keys its writes on the record's identity). The shapes a consumer
takes all use it:

* one batch at a time (`flywheel.runtime.consume.handle`): open, settle, commit — `commit`;
* one write in flight behind decoding (ingest's `flywheel.ingest.writer.WritePipeline`);
* several records in flight at once (`flywheel.runtime.inflight.InFlight`);
* records held past their fetch until a version is published (the trainer,
  `flywheel.trainer.learner.TrainerService`).

A commit refused because the partition moved in a rebalance is skipped with a warning: the
new owner reads from the last commit and redoes the rest idempotently.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

log = logging.getLogger("flywheel.consume")


class Positioned(Protocol):
    """A record's place in its topic (a `ConsumerRecord`, ingest's `RawRecord`)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...


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
        return self.finish_many(tp, (offset,))

    def finish_many(self, tp: TopicPartition, offsets: Iterable[int]) -> int | None:
        """`finish` for several offsets of one partition, the open set scanned once (a
        1,000-record ingest batch settles in one pass, not one `min` per record)."""
        open_ = self._open.setdefault(tp, set())
        done = set(offsets)
        open_ -= done
        self._highest[tp] = max(self._highest.get(tp, -1), *done)
        position = min(open_) if open_ else self._highest[tp] + 1
        if position <= self._committed.get(tp, -1):
            return None
        self._committed[tp] = position
        return position

    def in_flight(self) -> int:
        return sum(len(v) for v in self._open.values())


def _tp(record: Positioned) -> TopicPartition:
    return TopicPartition(record.topic, record.partition)


class OrderedCommits:
    """`OrderedOffsets` and the commit itself: open records, then commit them as settled."""

    def __init__(self, *, logger: logging.Logger = log) -> None:
        self.offsets = OrderedOffsets()
        self.log = logger

    def open(self, records: Iterable[Positioned]) -> None:
        for r in records:
            self.offsets.start(_tp(r), r.offset)

    async def settled(self, consumer: AIOKafkaConsumer, records: Iterable[Positioned]
                      ) -> None:
        """These records' effects are durable: commit as far as the order allows."""
        by_partition: dict[TopicPartition, list[int]] = {}
        for r in records:
            by_partition.setdefault(_tp(r), []).append(r.offset)
        positions: dict[TopicPartition, int] = {}
        for tp, offsets in by_partition.items():
            position = self.offsets.finish_many(tp, offsets)
            if position is not None:
                positions[tp] = position
        if not positions:
            return
        try:
            await consumer.commit(positions)
        except KafkaError as err:  # partitions moved in a rebalance: the new owner redoes
            self.log.warning("offset commit skipped (%s); redelivery is a no-op", err)

    def in_flight(self) -> int:
        return self.offsets.in_flight()


async def commit(consumer: AIOKafkaConsumer, records: Iterable[Positioned], *,
                 logger: logging.Logger = log) -> None:
    """Commit just past these records, per partition (their effects are durable, and
    nothing before them is still in flight: one batch at a time)."""
    records = list(records)
    commits = OrderedCommits(logger=logger)
    commits.open(records)
    await commits.settled(consumer, records)
