"""Miner: failed trajectories become verifiable environment tasks.

Subscribes: `<prefix>.trajectories` (its own group `miner.group_id`), batches.
Writes:     `failures` (classification + evidence, one per failed trajectory),
            `session_successes`, `tasks` (deduplicated by fingerprint, split train/holdout),
            `task_sources` (provenance), `events` + `outbox`.
Publishes (through the outbox): `TaskCreated` → `<prefix>.tasks`.

Invalid payloads are skipped here (ingest dead-letters them). Offsets are committed only
after the batch's transaction commits; redelivery is a no-op (keyed on trajectory_id).
"""

from __future__ import annotations

import logging
from typing import Any

from aiokafka import ConsumerRecord
from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker
from faststream.message import StreamMessage

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.ingest.decode import decode
from flywheel.mining.service import mine_batch
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.service import run_faststream
from flywheel.schemas import Trajectory

log = logging.getLogger("flywheel.miner")


async def _raw_batch(msg: StreamMessage[Any]) -> Any:
    return msg.raw_message


def build_app(settings: Settings) -> FastStream:
    cfg = settings.miner
    broker = KafkaBroker(resolve_bootstrap(settings), logger=log)
    engine = make_engine(resolve_db_url(settings), pool_size=2)
    max_bytes = settings.ingest.max_payload_bytes

    @broker.subscriber(
        settings.topics.trajectories,
        group_id=cfg.group_id,
        ack_policy=AckPolicy.NACK_ON_ERROR,
        batch=True,
        max_records=cfg.batch_max_records,
        auto_offset_reset="earliest",
        session_timeout_ms=settings.kafka.session_timeout_ms,
        heartbeat_interval_ms=settings.kafka.heartbeat_interval_ms,
        decoder=_raw_batch,
    )
    async def mine(batch: Any) -> None:
        records: tuple[ConsumerRecord[bytes, bytes], ...] = batch
        parsed = [decode(r.value or b"", max_bytes=max_bytes) for r in records]
        trajectories = [t for t in parsed if isinstance(t, Trajectory)]
        async with engine.begin() as conn:
            stats = await mine_batch(conn, trajectories,
                                     holdout_fraction=cfg.holdout_fraction,
                                     topics=settings.topics)
        if stats.failures or stats.upgraded:
            log.info("mined %d failures: %d new tasks, %d joined, %d unverifiable, "
                     "%d upgraded by retries", stats.failures, stats.tasks_created,
                     stats.tasks_joined, stats.unverifiable, stats.upgraded)

    app = FastStream(broker, logger=log)

    @app.after_shutdown
    async def _close() -> None:
        await engine.dispose()

    return app


def main() -> None:
    run_faststream(build_app)


if __name__ == "__main__":
    main()
