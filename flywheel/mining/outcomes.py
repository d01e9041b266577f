"""Feedback meets its trajectory: the feedback log, the outcome projection, re-mining.

Feedback is stored as it arrives (`feedback`, keyed by feedback_id: re-sent feedback is a
no-op). Feedback whose trajectory is stored (`trajectories`, by id or by
`metadata.request_id`) is applied in one transaction per trajectory: the feedback row is
claimed (`applied_to`, a conditional update, so two miners never both apply it), the
projection `trajectory_outcomes` (the trajectory with all its feedback folded in, in
arrival order) is written, `FeedbackReceived` is appended, and the trajectory is mined
again with it. Feedback that names a trajectory not stored yet stays pending and is tried
again on every sweep (`miner.feedback_sweep_s`) until it arrives; nothing is dropped.
Feedback that cannot be applied (a bug, a record that no longer validates, a value the
database refuses) is parked with its error and counted in status, never retried in a loop;
a transient database error (a deadlock with another miner, `flywheel.errors.is_transient`)
leaves it pending for the next sweep, and a lost connection is raised to the caller.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from flywheel.config import Topics
from flywheel.db import deadletters
from flywheel.db.outbox import append_events
from flywheel.errors import describe, failure_of, is_transient
from flywheel.events import (
    FeedbackReceived,
    FeedbackReceivedPayload,
    derived_event_id,
    storable_text,
)
from flywheel.feedback import Feedback
from flywheel.mining.classify import Labeller
from flywheel.mining.expected import feedback_calls
from flywheel.mining.feedback_apply import apply_feedback
from flywheel.mining.mine_batch import MineStats, lock_trajectory, remine
from flywheel.trajectory import Trajectory, parse_trajectory

log = logging.getLogger("flywheel.miner")

_STORE = text("""
INSERT INTO feedback (feedback_id, trajectory_id, request_id, record)
SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:trajectories AS uuid[]),
                     CAST(:requests AS text[]), CAST(:records AS jsonb[]))
ON CONFLICT (feedback_id) DO NOTHING RETURNING feedback_id""")
# Pending feedback with the trajectory it names, when that is stored: by id, else the newest
# trajectory whose metadata.request_id it is (the expression index serves the lookup).
_PENDING = text("""
SELECT f.seq, f.record AS feedback, t.trajectory_id, t.record AS trajectory
FROM feedback f
JOIN LATERAL (
    SELECT trajectory_id, record FROM trajectories
    WHERE f.trajectory_id IS NOT NULL AND trajectory_id = f.trajectory_id
    UNION ALL
    (SELECT trajectory_id, record FROM trajectories
     WHERE f.trajectory_id IS NULL
       AND ((record -> 'metadata') ->> 'request_id') = f.request_id
     ORDER BY ingested_at DESC LIMIT 1)
) t ON true
WHERE f.applied_at IS NULL AND f.error IS NULL
  AND (CAST(:ids AS uuid[]) IS NULL OR f.feedback_id = ANY(CAST(:ids AS uuid[])))
ORDER BY f.seq LIMIT :limit""")
_CURRENT = text("SELECT record FROM trajectory_outcomes WHERE trajectory_id = :id")
_CLAIM = text("""
UPDATE feedback SET applied_to = :t, applied_at = now()
WHERE feedback_id = :f AND applied_at IS NULL AND error IS NULL RETURNING 1""")
_PROJECT = text("""
INSERT INTO trajectory_outcomes (trajectory_id, status, is_failure, feedback_count, record)
VALUES (:id, :status, :failure, :n, CAST(:record AS jsonb))
ON CONFLICT (trajectory_id) DO UPDATE SET status = EXCLUDED.status,
    is_failure = EXCLUDED.is_failure, record = EXCLUDED.record, updated_at = now(),
    feedback_count = trajectory_outcomes.feedback_count + EXCLUDED.feedback_count""")
_PARK = text("UPDATE feedback SET error = :e WHERE feedback_id = ANY(CAST(:ids AS uuid[]))")


@dataclass
class FeedbackStats:
    stored: int = 0
    applied: int = 0
    parked: int = 0
    mined: MineStats = field(default_factory=MineStats)


async def store_feedback(conn: AsyncConnection, batch: Sequence[Feedback]) -> list[uuid.UUID]:
    """Append feedback to the log; returns the ids that were new."""
    if not batch:
        return []
    rows = await conn.execute(_STORE, {
        "ids": [f.feedback_id for f in batch],
        "trajectories": [f.trajectory_id for f in batch],
        "requests": [f.request_id for f in batch],
        "records": [f.model_dump_json(exclude_none=True) for f in batch]})
    return list(rows.scalars())


def received_event(fb: Feedback, before: Trajectory, after: Trajectory) -> FeedbackReceived:
    return FeedbackReceived(
        event_id=derived_event_id("feedback", fb.feedback_id),
        aggregate_id=str(after.trajectory_id),
        payload=FeedbackReceivedPayload(
            feedback_id=fb.feedback_id, trajectory_id=after.trajectory_id,
            request_id=fb.request_id or after.metadata.get("request_id"),
            previous_status=before.status, status=after.status, rating=fb.rating,
            correction=fb.correction is not None,
            structured=fb.feedback is not None and feedback_calls(fb.feedback) is not None))


async def _apply_to(conn: AsyncConnection, trajectory_id: uuid.UUID, ingested: Trajectory,
                    feedback: list[Feedback], stats: FeedbackStats, *, topics: Topics,
                    holdout_fraction: float, labeller: Labeller | None) -> None:
    await lock_trajectory(conn, ingested)  # then read the projection: no one moves it now
    current = (await conn.execute(_CURRENT, {"id": trajectory_id})).scalar()
    t = Trajectory.model_validate(current) if current is not None else ingested
    events = []
    for fb in feedback:
        if (await conn.execute(_CLAIM, {"t": trajectory_id, "f": fb.feedback_id})).scalar():
            after = apply_feedback(t, fb)
            events.append(received_event(fb, t, after))
            t = after
    if not events:
        return  # another miner applied them first
    await conn.execute(_PROJECT, {"id": trajectory_id, "status": t.status,
                                  "failure": t.is_failure, "n": len(events),
                                  "record": t.model_dump_json(exclude_none=True)})
    await append_events(conn, events, topics)
    mined = await remine(conn, t, holdout_fraction=holdout_fraction, topics=topics,
                         labeller=labeller)
    stats.applied += len(events)
    stats.mined.add(mined)


async def apply_pending(conn: AsyncConnection, *, topics: Topics, holdout_fraction: float,
                        labeller: Labeller | None = None, only: Sequence[uuid.UUID] | None = None,
                        limit: int = 1000) -> FeedbackStats:
    """Apply stored feedback whose trajectory is stored (`only`: just these feedback ids),
    one savepoint per trajectory, in arrival order."""
    stats = FeedbackStats()
    rows = (await conn.execute(_PENDING, {"ids": list(only) if only is not None else None,
                                          "limit": limit})).all()
    groups: dict[uuid.UUID, tuple[dict[str, object], list[Feedback]]] = {}
    for _seq, fb, trajectory_id, record in rows:
        groups.setdefault(trajectory_id, (record, []))[1].append(Feedback.model_validate(fb))
    for trajectory_id, (record, feedback) in groups.items():
        try:
            async with conn.begin_nested():
                await _apply_to(conn, trajectory_id, parse_trajectory(record), feedback,
                                stats, topics=topics, holdout_fraction=holdout_fraction,
                                labeller=labeller)
        except Exception as err:
            if is_transient(err):
                if not isinstance(err, DBAPIError) or err.connection_invalidated:
                    raise  # the connection is gone: the caller retries the whole call
                # A deadlock with another miner, a timeout: the savepoint rolled back, the
                # rest goes on, and the next sweep tries this trajectory again.
                log.warning("applying feedback to trajectory %s failed, retried by the next "
                            "sweep: %s", trajectory_id, describe(err))
                continue
            failure = failure_of(err)  # bad data or a bug: retrying every sweep cannot help
            log.error("could not apply feedback %s to trajectory %s (parked): %s",
                      [str(f.feedback_id) for f in feedback], trajectory_id, failure.error,
                      exc_info=err)
            await conn.execute(_PARK, {"e": storable_text(failure.error)[:2000],
                                       "ids": [f.feedback_id for f in feedback]})
            stats.parked += len(feedback)
    return stats


@dataclass(frozen=True, slots=True)
class FeedbackTaken:
    """What one batch of feedback did: stored, refused (parked), and applied."""

    stored: int
    parked: int
    stats: FeedbackStats


async def take_feedback(engine: AsyncEngine, good: Sequence[Feedback],
                        refused: Sequence[deadletters.Parked], *, topics: Topics,
                        holdout_fraction: float) -> FeedbackTaken:
    """The miner's feedback transaction: store a batch's feedback, park what its boundary
    refused, and apply the new feedback that meets its trajectory, all or nothing (a
    redelivered batch is a no-op: keyed on feedback_id and the dead letter's position)."""
    async with engine.begin() as conn:
        new = await store_feedback(conn, good)
        parked = await deadletters.park(conn, refused, topics)
        stats = await apply_pending(conn, topics=topics, only=new,
                                    holdout_fraction=holdout_fraction)
    return FeedbackTaken(len(new), parked, stats)
