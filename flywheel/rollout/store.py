"""Rollout repository: requests, scored groups, task statistics, admission budget.

Adds and flushes in the caller's transaction; never commits. A group's id is its request's
id, so a redelivered request is a no-op.
"""

from __future__ import annotations

import json
import uuid

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.config import Topics
from flywheel.db.outbox import append_events
from flywheel.events import (
    GroupScored,
    GroupScoredPayload,
    RolloutRequested,
    RolloutRequestedPayload,
    derived_event_id,
)
from flywheel.rollout.loop import GroupOutcome
from flywheel.rollout.select import TaskStat, retire_reason
from flywheel.tasks import TaskSpec


async def backlog(conn: AsyncConnection) -> int:
    """Trainable groups the trainer has not consumed yet."""
    return int((await conn.execute(text(
        "SELECT count(*) FROM rollout_groups WHERE trainable AND trained_at IS NULL"
    ))).scalar_one())


async def outstanding(conn: AsyncConnection) -> int:
    return int((await conn.execute(text(
        "SELECT count(*) FROM rollout_requests WHERE status = 'requested'"))).scalar_one())


async def candidate_stats(conn: AsyncConnection, envs: list[str] | None = None
                          ) -> list[TaskStat]:
    """Train tasks that are not retired (never holdout, never in a frozen eval set, never
    a validation task), of the policy's environments (`envs`; empty or None = all), each
    with its stratum for the selection's prior (`env|failure_mode`)."""
    rows = (await conn.execute(text("""
        SELECT t.task_id, coalesce(s.attempts, 0), coalesce(s.successes, 0),
               t.env || '|' || t.failure_mode
        FROM tasks t LEFT JOIN task_stats s ON s.task_id = t.task_id
        WHERE t.split = 'train' AND s.retired IS NULL
          AND t.task_id NOT IN (SELECT task_id FROM eval_set_tasks)
          AND t.task_id NOT IN (SELECT task_id FROM validation_tasks)
          AND (cardinality(CAST(:envs AS text[])) = 0 OR t.env = ANY(CAST(:envs AS text[])))
          AND t.task_id NOT IN (SELECT task_id FROM rollout_requests
                                WHERE status = 'requested')"""), {"envs": envs or []})).all()
    return [TaskStat(r[0], int(r[1]), int(r[2]), r[3]) for r in rows]


async def request_rollouts(conn: AsyncConnection, task_ids: list[uuid.UUID],
                           adapter_version: int | None, topics: Topics) -> list[uuid.UUID]:
    ids = [uuid.uuid4() for _ in task_ids]
    if not ids:
        return []
    await conn.execute(text("""
        INSERT INTO rollout_requests (request_id, task_id, adapter_version, status)
        SELECT unnest(CAST(:ids AS uuid[])), unnest(CAST(:tasks AS uuid[])), :v, 'requested'
    """), {"ids": ids, "tasks": task_ids, "v": adapter_version})
    events = [RolloutRequested(event_id=rid, aggregate_id=str(tid),
                               payload=RolloutRequestedPayload(request_id=rid, task_id=tid,
                                                               adapter_version=adapter_version))
              for rid, tid in zip(ids, task_ids, strict=True)]
    await append_events(conn, events, topics)
    return ids


async def already_scored(conn: AsyncConnection, group_id: uuid.UUID) -> bool:
    return (await conn.execute(text("SELECT 1 FROM rollout_groups WHERE group_id = :g"),
                               {"g": group_id})).scalar() is not None


async def record_group(conn: AsyncConnection, *, group_id: uuid.UUID, task: TaskSpec,
                       outcome: GroupOutcome, adapter: str | None, adapter_version: int | None,
                       temperature: float, worker: str, retire_after: int,
                       topics: Topics) -> bool:
    """Store the group, update the task's statistics, close the request, emit GroupScored.

    Returns False when this group was already recorded (redelivery).
    """
    payload = GroupScoredPayload(
        group_id=group_id, task_id=task.task_id, env=task.env, adapter=adapter,
        adapter_version=adapter_version, temperature=temperature, rollouts=outcome.rollouts,
        reward_mean=outcome.reward_mean, reward_std=outcome.reward_std,
        trainable=outcome.trainable, worker=worker)
    res = await conn.execute(text("""
        INSERT INTO rollout_groups (group_id, task_id, adapter_version, env, scored, not_run,
               reward_mean, reward_std, success_rate, trainable, rollouts, worker, duration_ms)
        VALUES (:g, :t, :v, :env, :scored, :not_run, :mean, :std, :succ, :trainable,
                CAST(:rollouts AS jsonb), :worker, :ms)
        ON CONFLICT (group_id) DO NOTHING RETURNING 1"""),
        {"g": group_id, "t": task.task_id, "v": adapter_version, "env": task.env,
         "scored": len(outcome.scored), "not_run": len(outcome.rollouts) - len(outcome.scored),
         "mean": outcome.reward_mean, "std": outcome.reward_std, "succ": outcome.success_rate,
         "trainable": outcome.trainable, "worker": worker, "ms": outcome.duration_ms,
         "rollouts": json.dumps([r.model_dump(mode="json") for r in outcome.rollouts])})
    if res.scalar() is None:
        return False
    successes = sum(1 for r in outcome.scored if r.failure_mode is None
                    and (r.reward or 0) >= 1.0)
    row = (await conn.execute(text("""
        INSERT INTO task_stats (task_id, groups, attempts, successes, not_run, last_sampled_at)
        VALUES (:t, 1, :a, :s, :n, now())
        ON CONFLICT (task_id) DO UPDATE SET groups = task_stats.groups + 1,
            attempts = task_stats.attempts + :a, successes = task_stats.successes + :s,
            not_run = task_stats.not_run + :n, last_sampled_at = now()
        RETURNING attempts, successes"""),
        {"t": task.task_id, "a": len(outcome.scored), "s": successes,
         "n": len(outcome.rollouts) - len(outcome.scored)})).one()
    reason = retire_reason(TaskStat(task.task_id, int(row[0]), int(row[1])), retire_after)
    if reason:
        await conn.execute(text("UPDATE task_stats SET retired = :r WHERE task_id = :t"),
                           {"r": reason, "t": task.task_id})
    await conn.execute(text("""UPDATE rollout_requests SET status = 'done', done_at = now()
                               WHERE request_id = :g"""), {"g": group_id})
    event = GroupScored(event_id=derived_event_id("group-scored", group_id),
                        aggregate_id=str(task.task_id), payload=payload)
    # Zero-variance groups are recorded (events, stats) but never sent to the trainer.
    # Only trainable groups reach the trainer; the rest are recorded, not published.
    await append_events(conn, [event], topics if outcome.trainable else None)
    return True


async def lock_scheduler(conn: AsyncConnection) -> None:
    """Serialize schedulers for the rest of the transaction (one tops up at a time)."""
    await conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('flywheel-scheduler'))"))


async def expire_requests(conn: AsyncConnection, *, older_than_s: float) -> int:
    """Expire requests unanswered for `older_than_s`; returns how many."""
    result = await conn.execute(text("""
        UPDATE rollout_requests SET status = 'expired', done_at = now()
        WHERE status = 'requested' AND created_at < now() - make_interval(secs => :ttl)"""),
        {"ttl": older_than_s})
    return int(result.rowcount)
