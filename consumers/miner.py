"""Miner: failed trajectories become verifiable environment tasks; feedback re-mines them.

Subscribes: `<prefix>.trajectories` (its own group `miner.group_id`), batches;
            `<prefix>.feedback` (group `miner.feedback_group_id`), batches of feedback.
Writes:     `failures` (classification + evidence, one per failed trajectory),
            `session_successes`, `tasks` (deduplicated by fingerprint, split train/holdout),
            `task_sources` (provenance), `feedback` (the log), `trajectory_outcomes` (the
            trajectory with its feedback applied), `dead_letters` (consumers `miner` and
            `feedback`), `events` + `outbox`.
Publishes (through the outbox): `TaskCreated` → `<prefix>.tasks`, `FeedbackReceived` →
            `<prefix>.ingest`, `RecordParked` → `<prefix>.parked`.

Invalid trajectories are skipped here: the decision is ingest's own (`flywheel.ingest.wire`,
a record without an agent named from its `flywheel-agent` header exactly as ingest names
it), and ingest dead-letters them. A trajectory with no outcome yet is not mined until
feedback brings one. A trajectory that cannot be mined is parked as the miner's dead letter
while the rest of its batch is mined (`flywheel.runtime.consume`); transient failures are
retried with backoff.

Feedback is decided by its own boundary (`flywheel.ingest.feedback_wire`): a record it refuses is
parked at once as a dead letter of consumer `feedback`, in the transaction that stores the
rest of its batch (`flywheel.mining.outcomes.take_feedback`). Feedback whose trajectory is
not stored yet waits in `feedback`; a sweep every `miner.feedback_sweep_s` applies it once
ingest has stored the trajectory. Both
subscribers commit offsets explicitly (MANUAL), only after their batch's transaction
committed; redelivery is a no-op (keyed on trajectory_id and feedback_id).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from aiokafka import ConsumerRecord
from faststream import FastStream
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.config import Settings
from flywheel.db import deadletters
from flywheel.db.engine import make_engine
from flywheel.errors import Failure, describe, is_transient
from flywheel.feedback import Feedback
from flywheel.formats import ParseContext, header_agent
from flywheel.ingest.feedback_wire import decode_feedback
from flywheel.ingest.wire import decode
from flywheel.mining.mine_batch import mine_batch
from flywheel.mining.outcomes import FeedbackStats, apply_pending, take_feedback
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
from flywheel.runtime.entrypoint import run_faststream
from flywheel.trajectory import Trajectory

log = logging.getLogger("flywheel.miner")
FEEDBACK_CONSUMER = "feedback"
"""`dead_letters.consumer` of feedback the miner's feedback subscriber refuses or parks."""


def _log_feedback(stats: FeedbackStats, stored: int, parked: int = 0) -> None:
    m = stats.mined
    if stored or stats.applied or stats.parked or parked:
        log.info("feedback: %d stored, %d refused, %d applied (%d failures mined: %d new "
                 "tasks, %d joined, %d unverifiable), %d could not be applied", stored,
                 parked, stats.applied, m.failures, m.tasks_created, m.tasks_joined,
                 m.unverifiable, stats.parked)


def miner_handlers(settings: Settings, engine: AsyncEngine) -> tuple[Process, Park]:
    """The miner's work on a batch of trajectories, and how it parks one (`build_app`
    wires them)."""
    cfg = settings.miner
    max_bytes = settings.ingest.max_payload_bytes

    async def mine(records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        parsed = [decode(r.value or b"", max_bytes=max_bytes,
                         context=ParseContext(header_agent=header_agent(r.headers)))
                  for r in records]
        trajectories = [t for t in parsed if isinstance(t, Trajectory)]
        async with engine.begin() as conn:
            stats = await mine_batch(conn, trajectories, holdout_fraction=cfg.holdout_fraction,
                                     topics=settings.topics)
        if stats.failures or stats.upgraded:
            log.info("mined %d failures: %d new tasks, %d joined, %d unverifiable, "
                     "%d upgraded by retries; %d awaiting an outcome", stats.failures,
                     stats.tasks_created, stats.tasks_joined, stats.unverifiable,
                     stats.upgraded, stats.awaiting)
        if stats.episodes or stats.episode_unverifiable:
            log.info("episodes: %d failures became episode tasks; %d episode candidates "
                     "unverifiable: %s", stats.episodes, sum(stats.episode_unverifiable.values()),
                     dict(stats.episode_unverifiable.most_common(5)))

    return mine, parker(engine, "miner", settings.topics)


def feedback_handlers(settings: Settings, engine: AsyncEngine) -> tuple[Process, Park]:
    """The feedback subscriber's work on a batch (decoded by its boundary, then the
    transaction `flywheel.mining.outcomes.take_feedback`), and how it parks one record
    whose processing keeps failing."""
    cfg = settings.miner
    topics = settings.topics
    max_bytes = settings.ingest.max_payload_bytes

    async def apply(records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        good: list[Feedback] = []
        refused: list[deadletters.Parked] = []
        for r in records:
            result = decode_feedback(r.value or b"", max_bytes=max_bytes)
            if isinstance(result, Feedback):
                good.append(result)
            else:
                refused.append(deadletters.Parked(
                    FEEDBACK_CONSUMER, r.topic, r.partition, r.offset, r.key, r.value or b"",
                    Failure("permanent", f"{result[0]}: {result[1]}")))
        taken = await take_feedback(engine, good, refused, topics=topics,
                                    holdout_fraction=cfg.holdout_fraction)
        if taken.parked:
            log.warning("parked %d of %d feedback messages the boundary refused",
                        taken.parked, len(records))
        _log_feedback(taken.stats, taken.stored, taken.parked)

    return apply, parker(engine, FEEDBACK_CONSUMER, topics)


async def sweep(engine: AsyncEngine, settings: Settings) -> None:
    """Apply feedback that arrived before its trajectory was stored, every few seconds."""
    while True:
        await asyncio.sleep(settings.miner.feedback_sweep_s)
        try:
            async with engine.begin() as conn:
                stats = await apply_pending(conn, topics=settings.topics,
                                            holdout_fraction=settings.miner.holdout_fraction)
            _log_feedback(stats, 0)
        except Exception as err:  # the next sweep tries again: nothing is lost either way
            if is_transient(err):  # the database may be restarting
                log.warning("feedback sweep failed (retried in %.0fs): %s",
                            settings.miner.feedback_sweep_s, describe(err))
            else:
                log.error("feedback sweep failed, a bug (retried in %.0fs): %s",
                          settings.miner.feedback_sweep_s, describe(err), exc_info=err)


def build_app(settings: Settings) -> FastStream:
    cfg = settings.miner
    broker = KafkaBroker(resolve_bootstrap(settings), logger=log)
    engine = make_engine(resolve_db_url(settings), pool_size=3)
    policy = RetryPolicy.of(settings.retry)
    mine, park = miner_handlers(settings, engine)
    apply, park_feedback = feedback_handlers(settings, engine)

    @subscribe_batch(broker, settings.topics.trajectories, settings, cfg.group_id,
                     max_records=cfg.batch_max_records)
    async def on_batch(batch: Any, msg: KafkaMessage) -> None:
        await handle(records_of(batch), msg.consumer, mine, park, policy, logger=log)

    @subscribe_batch(broker, settings.topics.feedback, settings, cfg.feedback_group_id,
                     max_records=cfg.batch_max_records)
    async def on_feedback(batch: Any, msg: KafkaMessage) -> None:
        await handle(records_of(batch), msg.consumer, apply, park_feedback, policy, logger=log)

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
