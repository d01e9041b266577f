"""Ingest: trajectories from Kafka into Postgres.

Subscribes: `<prefix>.trajectories` (group `ingest.group_id`), batches of raw records.
Writes:     `trajectories` (one statement per batch, idempotent on trajectory_id),
            `dead_letters` (one per bad source position), `events` + `outbox`.
Publishes (through the outbox): `DeadLettered` → `<prefix>.trajectories.dlq`,
            `TrajectoriesIngested` → `<prefix>.ingest`.

Every message ends as exactly one row or one dead letter: decoding never raises
(`flywheel.ingest.wire`), and a write Postgres refuses is narrowed down to the record it
refuses (`flywheel.runtime.consume.settle`), which becomes a dead letter (`unstorable`)
while the rest of its batch is stored. Transient failures (Postgres down) are retried with
backoff, for as long as they last.

Batches are pipelined: while batch N is written to Postgres, batch N+1 is decoded and
validated (the write's cost is in the database process, the validation's in ours). Offsets
are committed explicitly (ack policy MANUAL) and only for a batch whose transaction has
committed, in order. Should a batch still fail (its dead letters cannot be written either),
the consumer stops before anything later is committed: on restart the batch is redelivered,
and redelivery is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Coroutine, Sequence
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from faststream import FastStream
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.config import Settings, Topics
from flywheel.db.engine import make_engine
from flywheel.db.outbox import append_events
from flywheel.errors import Failure
from flywheel.events import Event
from flywheel.ingest.store import insert_dead_letters, insert_trajectories
from flywheel.ingest.wire import (
    Accepted,
    RawRecord,
    Rejected,
    classify_one,
    dead_letter_event,
    ingested_event,
)
from flywheel.runtime.consume import (
    RetryPolicy,
    records_of,
    rewind,
    settle,
    subscribe_batch,
)
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.entrypoint import run_faststream

log = logging.getLogger("flywheel.ingest")
Outcome = Accepted | Rejected
SHUTDOWN_WAIT_S = 15.0
"""How long shutdown waits for the batch being written (it may be retrying an outage)."""


async def write_batch(engine: AsyncEngine, topics: Topics,
                      outcomes: Sequence[Outcome]) -> None:
    """One transaction: rows, dead letters, their events and outbox rows."""
    records = [o.source for o in outcomes]
    accepted = [o for o in outcomes if isinstance(o, Accepted)]
    rejected = [o for o in outcomes if isinstance(o, Rejected)]
    async with engine.begin() as conn:
        written = await insert_trajectories(conn, accepted)
        new_dead = await insert_dead_letters(conn, rejected)
        events: list[Event] = [dead_letter_event(r) for r in new_dead]
        if written.inserted or new_dead:
            events.append(ingested_event(records, inserted=written.inserted,
                                         duplicates=written.duplicates,
                                         failures=written.failures,
                                         dead_lettered=len(new_dead)))
        await append_events(conn, events, topics)
    if new_dead:
        log.warning("dead-lettered %d of %d messages", len(new_dead), len(records))


def _position(o: Outcome) -> str:
    return f"{o.source.topic}[{o.source.partition}]@{o.source.offset}"


async def store(engine: AsyncEngine, topics: Topics, outcomes: Sequence[Outcome],
                policy: RetryPolicy) -> None:
    """Write a batch so that each record ends a row or a dead letter (see module doc)."""
    async def write(part: Sequence[Outcome]) -> None:
        await write_batch(engine, topics, part)

    async def refused(o: Outcome, failure: Failure) -> None:
        # Postgres refused a record validation let through: it is that record's dead letter.
        await write_batch(engine, topics, [Rejected(
            o.source, "unstorable", f"Postgres refused it ({failure.error}); fix the value "
            "it names, and report it: validation should have caught this")])

    await settle(outcomes, write, refused, policy, name=_position, logger=log)


class _Pipeline:
    """At most one batch write in flight; each commits its offsets once it is durable.

    A write task commits its own offsets after its transaction, and the next write starts
    only after `drain` has awaited the previous one, so commits happen in batch order and
    the committed position never runs ahead of what is in Postgres.
    """

    def __init__(self) -> None:
        self.pending: asyncio.Task[None] | None = None
        self.failed: BaseException | None = None

    async def drain(self) -> None:
        if self.failed is not None:
            raise RuntimeError("a batch write failed; the consumer is stopping") from self.failed
        if self.pending is None:
            return
        task, self.pending = self.pending, None
        try:
            await task
        except asyncio.CancelledError:
            raise  # shutdown gave up waiting: nothing was committed, the batch is redelivered
        except BaseException as err:
            # Fail-stop: nothing after this batch may be committed. The restart redelivers.
            self.failed = err
            log.error("writing a batch failed after retries; stopping: %s", err)
            os.kill(os.getpid(), signal.SIGTERM)
            raise

    def start(self, consumer: Any, records: list[RawRecord],
              write: Coroutine[Any, Any, None]) -> None:
        offsets: dict[TopicPartition, int] = {}
        for r in records:
            tp = TopicPartition(r.topic, r.partition)
            offsets[tp] = max(offsets.get(tp, 0), r.offset + 1)

        async def write_then_commit() -> None:
            await write
            try:
                await consumer.commit(offsets)
            except KafkaError as err:  # partitions moved in a rebalance: rows are durable
                log.warning("offset commit skipped (%s); redelivery to the new owner is a "
                            "no-op", err)

        self.pending = asyncio.create_task(write_then_commit())


def build_app(settings: Settings) -> FastStream:
    topics = settings.topics
    cfg = settings.ingest
    broker = KafkaBroker(resolve_bootstrap(settings), logger=log)
    engine = make_engine(resolve_db_url(settings), pool_size=2)
    pipeline = _Pipeline()
    policy = RetryPolicy.of(settings.retry)

    @subscribe_batch(broker, topics.trajectories, settings, cfg.group_id,
                     max_records=cfg.batch_max_records, batch_timeout_ms=cfg.batch_timeout_ms,
                     # Room for a whole batch from one partition in one fetch.
                     max_partition_fetch_bytes=max(1 << 20, cfg.batch_max_records * 4096))
    async def ingest(batch: Any, msg: KafkaMessage) -> None:
        consumed: list[ConsumerRecord[bytes, bytes]] = records_of(batch)
        try:
            records = [RawRecord(r.topic, r.partition, r.offset, r.key, r.value or b"",
                                 tuple(r.headers or ())) for r in consumed]
            outcomes = [classify_one(r, cfg.max_payload_bytes) for r in records]
            await pipeline.drain()  # the previous batch is durable and committed
        except BaseException:
            rewind(msg.consumer, consumed)  # never let a later commit pass this batch
            raise
        pipeline.start(msg.consumer, records, store(engine, topics, outcomes, policy))

    app = FastStream(broker, logger=log)

    @app.on_shutdown
    async def _finish() -> None:
        try:
            await asyncio.wait_for(pipeline.drain(), SHUTDOWN_WAIT_S)
        except Exception as err:  # already logged; the batch will be redelivered
            log.warning("last batch not committed: %s", err or type(err).__name__)

    @app.after_shutdown
    async def _close() -> None:
        await engine.dispose()

    return app


def main() -> None:
    run_faststream(build_app)


if __name__ == "__main__":
    main()
