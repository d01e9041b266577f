"""Miner: failed trajectories become verifiable environment tasks; feedback re-mines them.

Subscribes: `<prefix>.trajectories` (its own group `miner.group_id`), batches;
            `<prefix>.feedback` (group `miner.feedback_group_id`), batches of feedback.
Writes:     `failures` (classification + evidence, one per failed trajectory),
            `session_successes`, `tasks` (deduplicated by fingerprint, split train/holdout),
            `task_sources` (provenance), `feedback` (the log), `trajectory_outcomes` (the
            trajectory with its feedback applied), `dead_letters` (bad feedback),
            `events` + `outbox`.
Publishes (through the outbox): `TaskCreated` → `<prefix>.tasks`, `FeedbackReceived` →
            `<prefix>.ingest`, `DeadLettered` (bad feedback) → `<prefix>.trajectories.dlq`.

Invalid trajectories are skipped here (ingest dead-letters them); a record without an agent
is named from its `flywheel-agent` header exactly as ingest names it. A trajectory with no
outcome yet is not mined until feedback brings one. Feedback whose trajectory is not stored
yet waits in `feedback`; a sweep every `miner.feedback_sweep_s` applies it once ingest has
stored the trajectory. Offsets are committed only after the batch's transaction commits;
redelivery is a no-op (keyed on trajectory_id and feedback_id).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiokafka import ConsumerRecord
from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker
from faststream.message import StreamMessage
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.db.outbox import append_events
from flywheel.feedback import Feedback
from flywheel.formats import ParseContext, header_agent
from flywheel.ingest.decode import RawRecord, Rejected, dead_letter_event, decode
from flywheel.ingest.feedback import decode_feedback
from flywheel.ingest.store import insert_dead_letters
from flywheel.mining.outcomes import FeedbackStats, apply_pending, store_feedback
from flywheel.mining.service import mine_batch
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.service import run_faststream
from flywheel.schemas import Trajectory

log = logging.getLogger("flywheel.miner")


async def _raw_batch(msg: StreamMessage[Any]) -> Any:
    return msg.raw_message


def _log_feedback(stats: FeedbackStats, stored: int) -> None:
    m = stats.mined
    if stored or stats.applied or stats.parked:
        log.info("feedback: %d stored, %d applied (%d failures mined: %d new tasks, %d joined,"
                 " %d unverifiable), %d parked", stored, stats.applied, m.failures,
                 m.tasks_created, m.tasks_joined, m.unverifiable, stats.parked)


async def sweep(engine: AsyncEngine, settings: Settings) -> None:
    """Apply feedback that arrived before its trajectory was stored, every few seconds."""
    while True:
        await asyncio.sleep(settings.miner.feedback_sweep_s)
        try:
            async with engine.begin() as conn:
                stats = await apply_pending(conn, topics=settings.topics,
                                            holdout_fraction=settings.miner.holdout_fraction)
            _log_feedback(stats, 0)
        except Exception as err:  # the database may be restarting: the next sweep retries
            log.warning("feedback sweep failed (retried in %.0fs): %s",
                        settings.miner.feedback_sweep_s, err)


def build_app(settings: Settings) -> FastStream:
    cfg = settings.miner
    topics = settings.topics
    broker = KafkaBroker(resolve_bootstrap(settings), logger=log)
    engine = make_engine(resolve_db_url(settings), pool_size=3)
    max_bytes = settings.ingest.max_payload_bytes
    @broker.subscriber(
        topics.trajectories, group_id=cfg.group_id, ack_policy=AckPolicy.NACK_ON_ERROR,
        batch=True, max_records=cfg.batch_max_records, auto_offset_reset="earliest",
        session_timeout_ms=settings.kafka.session_timeout_ms,
        heartbeat_interval_ms=settings.kafka.heartbeat_interval_ms, decoder=_raw_batch)
    async def mine(batch: Any) -> None:
        records: tuple[ConsumerRecord[bytes, bytes], ...] = batch
        parsed = [decode(r.value or b"", max_bytes=max_bytes,
                         context=ParseContext(header_agent=header_agent(r.headers)))
                  for r in records]
        trajectories = [t for t in parsed if isinstance(t, Trajectory)]
        async with engine.begin() as conn:
            stats = await mine_batch(conn, trajectories, holdout_fraction=cfg.holdout_fraction,
                                     topics=topics)
        if stats.failures or stats.upgraded:
            log.info("mined %d failures: %d new tasks, %d joined, %d unverifiable, "
                     "%d upgraded by retries; %d awaiting an outcome", stats.failures,
                     stats.tasks_created, stats.tasks_joined, stats.unverifiable,
                     stats.upgraded, stats.awaiting)

    @broker.subscriber(
        topics.feedback, group_id=cfg.feedback_group_id, ack_policy=AckPolicy.NACK_ON_ERROR,
        batch=True, max_records=cfg.batch_max_records, auto_offset_reset="earliest",
        session_timeout_ms=settings.kafka.session_timeout_ms,
        heartbeat_interval_ms=settings.kafka.heartbeat_interval_ms, decoder=_raw_batch)
    async def feedback(batch: Any) -> None:
        records: tuple[ConsumerRecord[bytes, bytes], ...] = batch
        good: list[Feedback] = []
        bad: list[Rejected] = []
        for r in records:
            result = decode_feedback(r.value or b"", max_bytes=max_bytes)
            if isinstance(result, Feedback):
                good.append(result)
            else:
                bad.append(Rejected(RawRecord(r.topic, r.partition, r.offset, r.key,
                                              r.value or b""), *result))
        async with engine.begin() as conn:
            new = await store_feedback(conn, good)
            dead = await insert_dead_letters(conn, bad)
            await append_events(conn, [dead_letter_event(r) for r in dead], topics)
            stats = await apply_pending(conn, topics=topics, only=new,
                                        holdout_fraction=cfg.holdout_fraction)
        if dead:
            log.warning("dead-lettered %d of %d feedback messages", len(dead), len(records))
        _log_feedback(stats, len(new))

    app = FastStream(broker, logger=log)
    sweeper: dict[str, asyncio.Task[None]] = {}

    @app.after_startup
    async def _start_sweep() -> None:
        sweeper["task"] = asyncio.create_task(sweep(engine, settings))

    @app.on_shutdown
    async def _stop_sweep() -> None:
        task = sweeper.pop("task", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @app.after_shutdown
    async def _close() -> None:
        await engine.dispose()

    return app


def main() -> None:
    run_faststream(build_app)


if __name__ == "__main__":
    main()
