"""Miner: failed trajectories become verifiable environment tasks.

Subscribes: `<prefix>.trajectories` (its own group `miner.group_id`), batches.
Writes:     `failures` (classification + evidence, one per failed trajectory),
            `session_successes`, `tasks` (deduplicated by fingerprint, split train/holdout),
            `task_sources` (provenance), `dead_letters` (consumer `miner`), `events` + `outbox`.
Publishes (through the outbox): `TaskCreated` → `<prefix>.tasks`, `RecordParked` →
            `<prefix>.parked`.

Invalid payloads are skipped here: the decision is ingest's own (`flywheel.ingest.decode`),
and ingest dead-letters them. A trajectory that cannot be mined is parked as the miner's dead
letter while the rest of its batch is mined (`flywheel.runtime.consume`); transient failures
are retried with backoff. Offsets are committed only after the batch's transaction commits;
redelivery is a no-op (keyed on trajectory_id).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from aiokafka import ConsumerRecord
from faststream import FastStream
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.ingest.decode import decode
from flywheel.mining.service import mine_batch
from flywheel.runtime.consume import (
    Park,
    Process,
    RetryPolicy,
    handle,
    parker,
    records_of,
    subscribe_batch,
)
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.service import run_faststream
from flywheel.schemas import Trajectory

log = logging.getLogger("flywheel.miner")


def miner_handlers(settings: Settings, engine: AsyncEngine) -> tuple[Process, Park]:
    """The miner's work on a batch, and how it parks a record (`build_app` wires them)."""
    cfg = settings.miner
    max_bytes = settings.ingest.max_payload_bytes

    async def mine(records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        parsed = [decode(r.value or b"", max_bytes=max_bytes) for r in records]
        trajectories = [t for t in parsed if isinstance(t, Trajectory)]
        async with engine.begin() as conn:
            stats = await mine_batch(conn, trajectories, holdout_fraction=cfg.holdout_fraction,
                                     topics=settings.topics)
        if stats.failures or stats.upgraded:
            log.info("mined %d failures: %d new tasks, %d joined, %d unverifiable, "
                     "%d upgraded by retries", stats.failures, stats.tasks_created,
                     stats.tasks_joined, stats.unverifiable, stats.upgraded)

    return mine, parker(engine, "miner", settings.topics)


def build_app(settings: Settings) -> FastStream:
    broker = KafkaBroker(resolve_bootstrap(settings), logger=log)
    engine = make_engine(resolve_db_url(settings), pool_size=2)
    policy = RetryPolicy.of(settings.retry)
    mine, park = miner_handlers(settings, engine)

    @subscribe_batch(broker, settings.topics.trajectories, settings, settings.miner.group_id,
                     max_records=settings.miner.batch_max_records)
    async def on_batch(batch: Any, msg: KafkaMessage) -> None:
        await handle(records_of(batch), msg.consumer, mine, park, policy, logger=log)

    app = FastStream(broker, logger=log)

    @app.after_shutdown
    async def _close() -> None:
        await engine.dispose()

    return app


def main() -> None:
    run_faststream(build_app)


if __name__ == "__main__":
    main()
