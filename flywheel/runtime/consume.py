"""What every Kafka consumer shares: subscriber defaults, the raw decoder, explicit offset
commits, and the failure policy that ends every message processed or parked.

Offsets. Every subscriber is `AckPolicy.MANUAL` and commits exactly the records it settled,
after their effects (rows, or dead letters) are durable (`flywheel.runtime.commits`, the
one commit helper every consumer uses). Read against FastStream 0.7's code:
with MANUAL an exception escaping a handler commits nothing and seeks nowhere, so the next
batch's commit would move past the failed one (how ingest lost whole batches); with
`NACK_ON_ERROR` a batch is acked by `consumer.commit()` (every assigned partition's position)
and nacked by seeking each partition back to its earliest record, which loses nothing but
redelivers a poisoned batch at once, forever (the miner's hot loop). So here nothing but a
cancellation escapes `settle`, and `handle` rewinds the records if anything still does.

Failures (`flywheel.errors`). Transient ones are retried with capped exponential backoff
until they pass, never parked. Anything else is narrowed down by splitting the batch in
halves until the record that fails is alone; a permanent failure is then parked at once, an
unclassified one (a bug) after `bug_attempts` tries. Parked = a dead letter of that consumer
(`dead_letters.consumer`, `RecordParked`), so the consumer moves on and the operator sees it
in `flywheel status`, `/metrics` and the dashboard.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError
from faststream import AckPolicy
from pydantic import ValidationError

from flywheel.config import RetrySettings, Settings, Topics
from flywheel.db import deadletters
from flywheel.errors import Failure, InvalidRecord, describe, failure_of, is_transient
from flywheel.events import Event, parse_event
from flywheel.runtime.commits import commit

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer, ConsumerRecord
    from faststream.kafka import KafkaBroker
    from faststream.kafka.subscriber.usecase import BatchSubscriber, DefaultSubscriber
    from faststream.message import StreamMessage
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

log = logging.getLogger("flywheel.consume")
T = TypeVar("T")
R = TypeVar("R")
Process = Callable[[Sequence["ConsumerRecord[bytes, bytes]"]], Awaitable[None]]
"""A consumer's work on some records, in one transaction (all or nothing)."""
Park = Callable[["ConsumerRecord[bytes, bytes]", Failure], Awaitable[None]]
"""How a consumer durably records one record it gives up on."""


def subscribe(broker: KafkaBroker, topic: str, settings: Settings, group_id: str, *,
              slow: bool = False) -> DefaultSubscriber:
    """`@subscribe(broker, topic, settings, group)`: one record per call, with the shared
    defaults: explicit commits (MANUAL), reading from the start, the raw decoder, and the
    session, heartbeat and poll bounds from `Settings` (`slow`: one message can take
    minutes, as rollouts, evaluations and training steps do on a CPU)."""
    k = settings.kafka
    return broker.subscriber(
        topic, group_id=group_id, ack_policy=AckPolicy.MANUAL, auto_offset_reset="earliest",
        session_timeout_ms=k.session_timeout_ms, heartbeat_interval_ms=k.heartbeat_interval_ms,
        max_poll_interval_ms=k.slow_max_poll_interval_ms if slow else k.max_poll_interval_ms,
        decoder=raw_records)


def subscribe_batch(broker: KafkaBroker, topic: str, settings: Settings, group_id: str, *,
                    max_records: int, slow: bool = False, batch_timeout_ms: int = 200,
                    max_partition_fetch_bytes: int = 1 << 20) -> BatchSubscriber:
    """`subscribe` for batches of up to `max_records` (the handler gets a tuple)."""
    k = settings.kafka
    return broker.subscriber(
        topic, batch=True, max_records=max_records, batch_timeout_ms=batch_timeout_ms,
        max_partition_fetch_bytes=max_partition_fetch_bytes, group_id=group_id,
        ack_policy=AckPolicy.MANUAL, auto_offset_reset="earliest",
        session_timeout_ms=k.session_timeout_ms, heartbeat_interval_ms=k.heartbeat_interval_ms,
        max_poll_interval_ms=k.slow_max_poll_interval_ms if slow else k.max_poll_interval_ms,
        decoder=raw_records)


async def raw_records(msg: StreamMessage[Any]) -> Any:
    """The decoder of every subscriber: skip FastStream's JSON decoding, hand the handler the
    `ConsumerRecord` (or a batch's tuple of them) with its bytes and position."""
    return msg.raw_message


def records_of(body: Any) -> list[ConsumerRecord[bytes, bytes]]:
    """A handler's body (one record, or a batch's tuple) as a list of records."""
    return list(body) if isinstance(body, tuple | list) else [body]


def read_event(record: ConsumerRecord[bytes, bytes]) -> Event:
    """The event a record carries; `InvalidRecord` (permanent: parked) when it is none."""
    try:
        return parse_event(record.value or b"")
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}"
                             for e in err.errors()[:3])
        raise InvalidRecord(f"{label(record)} is not a flywheel event ({problems})") from None


def label(record: ConsumerRecord[Any, Any]) -> str:
    return f"{record.topic}[{record.partition}]@{record.offset}"


def rewind(consumer: AIOKafkaConsumer, records: Sequence[ConsumerRecord[Any, Any]]) -> None:
    """Seek each partition back to its earliest unsettled record: fetched next, not skipped."""
    earliest: dict[TopicPartition, int] = {}
    for r in records:
        tp = TopicPartition(r.topic, r.partition)
        earliest[tp] = min(earliest.get(tp, r.offset), r.offset)
    for tp, offset in earliest.items():
        try:
            consumer.seek(tp, offset)
        except (KafkaError, ValueError, AssertionError) as err:  # no longer assigned: the
            log.warning("could not rewind %s (%s)", tp, err)  # new owner reads from the commit


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    initial_s: float = 0.5
    max_s: float = 30.0
    bug_attempts: int = 3

    @classmethod
    def of(cls, retry: RetrySettings) -> RetryPolicy:
        return cls(retry.backoff_initial_s, retry.backoff_max_s, retry.bug_attempts)

    def delay(self, attempt: int) -> float:
        """Seconds before retry number `attempt + 1`: doubling, capped."""
        return float(min(self.max_s, self.initial_s * 2 ** min(attempt, 32)))


async def transiently(fn: Callable[[], Awaitable[T]], policy: RetryPolicy, *, what: str,
                      logger: logging.Logger = log) -> T:
    """`fn()` until it returns or fails with a non-transient error (raised to the caller).
    Transient failures are retried for as long as they last, each one logged."""
    attempt = 0
    while True:
        try:
            return await fn()
        except Exception as err:
            if not is_transient(err):
                raise
            pause = policy.delay(attempt)
            attempt += 1
            logger.warning("%s: transient failure #%d (%s); retrying in %.1fs", what, attempt,
                           describe(err), pause)
            await asyncio.sleep(pause)


async def settle(items: Sequence[R], process: Callable[[Sequence[R]], Awaitable[None]],
                 park: Callable[[R, Failure], Awaitable[None]], policy: RetryPolicy, *,
                 name: Callable[[R], str], logger: logging.Logger = log) -> int:
    """Process `items` so that each one ends processed or parked; returns how many were
    parked. `process` does one sub-batch's work in one transaction (all or nothing);
    `park` durably records one item's failure. Only a cancellation, or `park` itself
    failing for good, escapes."""
    if not items:
        return 0
    what = f"{name(items[0])} (+{len(items) - 1})" if len(items) > 1 else name(items[0])
    try:
        await transiently(lambda: process(items), policy, what=what, logger=logger)
        return 0
    except Exception as err:
        first = err
    if len(items) > 1:  # which one? halve until it is alone; the rest goes through
        mid = len(items) // 2
        return (await settle(items[:mid], process, park, policy, name=name, logger=logger)
                + await settle(items[mid:], process, park, policy, name=name, logger=logger))
    failure, error = failure_of(first), first
    tries = 1 if failure.kind == "permanent" else policy.bug_attempts
    for attempt in range(1, tries):
        await asyncio.sleep(policy.delay(attempt - 1))
        try:
            await transiently(lambda: process(items), policy, what=what, logger=logger)
            return 0
        except Exception as err:
            failure, error = failure_of(err), err
    if failure.kind == "bug":
        logger.error("%s parked after %d tries, a bug: %s", what, tries, failure.error,
                     exc_info=error)
    else:
        logger.warning("%s parked: %s", what, failure.error)
    await transiently(lambda: park(items[0], failure), policy, what=f"parking {what}",
                      logger=logger)
    return 1


def parker(engine: AsyncEngine, consumer: str, topics: Topics, *,
           also: Callable[[AsyncConnection, ConsumerRecord[bytes, bytes], Failure],
                          Awaitable[None]] | None = None) -> Park:
    """`park` for `settle` over Kafka records: the record as a dead letter of `consumer`
    (and `also`, the consumer's own bookkeeping) in one transaction."""
    async def park(record: ConsumerRecord[bytes, bytes], failure: Failure) -> None:
        async with engine.begin() as conn:
            await deadletters.park(conn, [deadletters.Parked(
                consumer, record.topic, record.partition, record.offset, record.key,
                record.value or b"", failure)], topics)
            if also is not None:
                await also(conn, record, failure)
    return park


async def handle(records: Sequence[ConsumerRecord[bytes, bytes]], consumer: AIOKafkaConsumer,
                 process: Process, park: Park, policy: RetryPolicy, *,
                 logger: logging.Logger = log) -> int:
    """A handler's whole job: settle the records, then commit them. If anything escapes
    (cancellation, or parking failing for good), they are rewound first, so no later commit
    can pass them; a failure also pauses, so it cannot turn into a hot loop."""
    try:
        parked = await settle(records, process, park, policy, name=label, logger=logger)
    except asyncio.CancelledError:
        rewind(consumer, records)
        raise
    except Exception as err:
        rewind(consumer, records)
        logger.critical("could not settle %d records, not even park them (%s); they are "
                        "redelivered", len(records), describe(err), exc_info=err)
        await asyncio.sleep(policy.max_s)
        raise
    await commit(consumer, records)
    return parked
