"""Ingest: trajectories from Kafka into Postgres.

Subscribes: `<prefix>.trajectories` (group `ingest.group_id`), batches of raw records.
Writes:     `trajectories` (one statement per batch, idempotent on trajectory_id),
            `dead_letters` (one per bad source position), `events` + `outbox`.
Publishes (through the outbox): `DeadLettered` → `<prefix>.trajectories.dlq`,
            `TrajectoriesIngested` → `<prefix>.ingest`.

Batches are pipelined: while batch N is written to Postgres, batch N+1 is decoded and
validated (the write's cost is in the database process, the validation's in ours). Offsets
are committed explicitly (ack policy MANUAL) and only for a batch whose transaction has
committed, in order. A write that still fails after its retries stops the consumer before
anything later is committed: on restart the batch is redelivered, and redelivery is a no-op.
Bad input never raises: it is dead-lettered.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any

import asyncpg
from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from faststream.message import StreamMessage
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from flywheel.config import Settings, Topics
from flywheel.db.engine import make_engine
from flywheel.db.outbox import append_events
from flywheel.events import Event
from flywheel.ingest.decode import (
    Accepted,
    RawRecord,
    Rejected,
    classify,
    dead_letter_event,
    ingested_event,
)
from flywheel.ingest.store import insert_dead_letters, insert_trajectories
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.service import run_faststream

log = logging.getLogger("flywheel.ingest")


def _transient(err: BaseException) -> bool:
    # The COPY path raises asyncpg's own errors (not wrapped by SQLAlchemy).
    if isinstance(err, OperationalError | OSError | asyncio.TimeoutError
                  | asyncpg.TransactionRollbackError | asyncpg.PostgresConnectionError
                  | asyncpg.InterfaceError | asyncpg.OperatorInterventionError):
        return True
    return isinstance(err, DBAPIError) and err.connection_invalidated


async def _raw_batch(msg: StreamMessage[Any]) -> Any:
    # Skip FastStream's per-message JSON decoding: classify() validates straight from bytes.
    return msg.raw_message


@retry(retry=retry_if_exception(_transient), stop=stop_after_attempt(5),
       wait=wait_exponential(multiplier=0.2, max=5), reraise=True)
async def write_batch(engine: AsyncEngine, topics: Topics, records: list[RawRecord],
                      accepted: list[Accepted], rejected: list[Rejected]) -> None:
    """One transaction: rows, dead letters, their events and outbox rows."""
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

    @broker.subscriber(
        topics.trajectories,
        group_id=cfg.group_id,
        ack_policy=AckPolicy.MANUAL,
        batch=True,
        max_records=cfg.batch_max_records,
        batch_timeout_ms=cfg.batch_timeout_ms,
        # Room for a whole batch from one partition in one fetch.
        max_partition_fetch_bytes=max(1 << 20, cfg.batch_max_records * 4096),
        auto_offset_reset="earliest",
        session_timeout_ms=settings.kafka.session_timeout_ms,
        heartbeat_interval_ms=settings.kafka.heartbeat_interval_ms,
        decoder=_raw_batch,
    )
    async def ingest(batch: Any, msg: KafkaMessage) -> None:
        consumed: tuple[ConsumerRecord[bytes, bytes], ...] = batch
        records = [RawRecord(r.topic, r.partition, r.offset, r.key, r.value or b"",
                             tuple(r.headers or ())) for r in consumed]
        accepted, rejected = classify(records, max_bytes=cfg.max_payload_bytes)
        await pipeline.drain()  # the previous batch is durable and committed
        pipeline.start(msg.consumer, records,
                       write_batch(engine, topics, records, accepted, rejected))

    app = FastStream(broker, logger=log)

    @app.on_shutdown
    async def _finish() -> None:
        try:
            await pipeline.drain()
        except Exception as err:  # already logged; the batch will be redelivered
            log.warning("last batch not committed: %s", err)

    @app.after_shutdown
    async def _close() -> None:
        await engine.dispose()

    return app


def main() -> None:
    run_faststream(build_app)


if __name__ == "__main__":
    main()
