"""Ingest: trajectories from Kafka into Postgres.

Subscribes: `<prefix>.trajectories` (group `ingest.group_id`), batches of raw records.
Writes:     `trajectories` (one statement per batch, idempotent on trajectory_id),
            `dead_letters` (one per bad source position), `events` + `outbox`.
Publishes (through the outbox): `DeadLettered` → `<prefix>.trajectories.dlq`,
            `TrajectoriesIngested` → `<prefix>.ingest`.

Offsets are committed only after the batch's transaction commits (ack policy
NACK_ON_ERROR: a failed write rewinds the batch for redelivery). Bad input never raises.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka import ConsumerRecord
from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker
from faststream.message import StreamMessage
from sqlalchemy.exc import DBAPIError, OperationalError
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.db.repo import append_events, insert_dead_letters, insert_trajectories
from flywheel.events import Event
from flywheel.ingest import RawRecord, classify, dead_letter_event, ingested_event
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url

log = logging.getLogger("flywheel.ingest")


def _transient(err: BaseException) -> bool:
    if isinstance(err, OperationalError | OSError | asyncio.TimeoutError):
        return True
    return isinstance(err, DBAPIError) and err.connection_invalidated


async def _raw_batch(msg: StreamMessage[Any]) -> Any:
    # Skip FastStream's per-message JSON decoding: classify() validates straight from bytes.
    return msg.raw_message


def build_app(settings: Settings) -> FastStream:
    topics = settings.topics
    cfg = settings.ingest
    broker = KafkaBroker(resolve_bootstrap(settings), logger=log)
    engine = make_engine(resolve_db_url(settings), pool_size=2)

    @retry(retry=retry_if_exception(_transient), stop=stop_after_attempt(5),
           wait=wait_exponential(multiplier=0.2, max=5), reraise=True)
    async def write(records: list[RawRecord]) -> None:
        accepted, rejected = classify(records, max_bytes=cfg.max_payload_bytes)
        async with engine.begin() as conn:
            written = await insert_trajectories(conn, accepted)
            new_dead = await insert_dead_letters(conn, rejected)
            events: list[tuple[Event, str]] = [
                (dead_letter_event(r), topics.trajectories_dlq) for r in new_dead]
            if written.inserted or new_dead:
                events.append((ingested_event(records, inserted=written.inserted,
                                              duplicates=written.duplicates,
                                              failures=written.failures,
                                              dead_lettered=len(new_dead)), topics.ingest))
            await append_events(conn, events)
        if new_dead:
            log.warning("dead-lettered %d of %d messages", len(new_dead), len(records))

    @broker.subscriber(
        topics.trajectories,
        group_id=cfg.group_id,
        ack_policy=AckPolicy.NACK_ON_ERROR,
        batch=True,
        max_records=cfg.batch_max_records,
        batch_timeout_ms=cfg.batch_timeout_ms,
        auto_offset_reset="earliest",
        session_timeout_ms=settings.kafka.session_timeout_ms,
        heartbeat_interval_ms=settings.kafka.heartbeat_interval_ms,
        decoder=_raw_batch,
    )
    async def ingest(batch: Any) -> None:
        records: tuple[ConsumerRecord[bytes, bytes], ...] = batch
        await write([RawRecord(r.topic, r.partition, r.offset, r.key, r.value or b"")
                     for r in records])

    app = FastStream(broker, logger=log)

    @app.after_shutdown
    async def _close() -> None:
        await engine.dispose()

    return app


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(build_app(Settings()).run())


if __name__ == "__main__":
    main()
