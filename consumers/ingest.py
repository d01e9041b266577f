"""Ingest: trajectories from Kafka into Postgres (wiring; the service is
`flywheel.ingest.writer`, the boundary `flywheel.ingest.wire`).

Subscribes: `<prefix>.trajectories` (group `ingest.group_id`), batches of raw records.
Writes:     `trajectories` (one statement per batch, idempotent on trajectory_id),
            `dead_letters` (one per bad source position), `events` + `outbox`.
Publishes (through the outbox): `DeadLettered` → `<prefix>.trajectories.dlq`,
            `TrajectoriesIngested` → `<prefix>.ingest`.

Every message ends as exactly one row or one dead letter: decoding never raises, and a
write Postgres refuses is narrowed down to the record it refuses. Batches are pipelined:
while batch N is written, batch N+1 is decoded and validated here. Offsets are committed
explicitly (ack policy MANUAL), in order, only for a batch whose transaction has committed
(`WritePipeline`); should a batch still fail, the consumer stops before anything later is
committed, and the restart redelivers it (a no-op).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka import ConsumerRecord
from faststream import FastStream
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.ingest.wire import RawRecord, classify_one
from flywheel.ingest.writer import WritePipeline, store
from flywheel.runtime.consume import RetryPolicy, records_of, rewind, subscribe_batch
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.entrypoint import run_faststream

log = logging.getLogger("flywheel.ingest")
SHUTDOWN_WAIT_S = 15.0
"""How long shutdown waits for the batch being written (it may be retrying an outage)."""


def build_app(settings: Settings) -> FastStream:
    topics = settings.topics
    cfg = settings.ingest
    broker = KafkaBroker(resolve_bootstrap(settings), logger=log)
    engine = make_engine(resolve_db_url(settings), pool_size=2)
    pipeline = WritePipeline()
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
