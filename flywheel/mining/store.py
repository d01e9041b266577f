"""Mining repository: failures, session successes, tasks with provenance, eval sets.

Adds and flushes inside the caller's transaction; never commits. Every write is keyed so a
redelivered trajectory is a no-op.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.config import Topics
from flywheel.db.outbox import append_events
from flywheel.errors import PermanentError
from flywheel.events import (
    EvalSetFrozen,
    EvalSetFrozenPayload,
    TaskCreated,
    TaskCreatedPayload,
    derived_event_id,
)
from flywheel.mining.build import Unverifiable
from flywheel.mining.classify import Classification
from flywheel.tasks import TaskSpec
from flywheel.trajectory import Trajectory


async def record_success(conn: AsyncConnection, t: Trajectory, key: str, *,
                         as_ingested: bool = True) -> None:
    """Keep a success for later retries to find. `as_ingested`: the record as it came off
    the topic, skipped once feedback has given the trajectory another outcome (its
    projection row exists); else the trajectory with its feedback applied, which wins."""
    assert t.session_id is not None
    sql = """INSERT INTO session_successes (trajectory_id, session_id, request_key, record)
             SELECT CAST(:id AS uuid), CAST(:session AS text), CAST(:key AS text),
                    CAST(:record AS jsonb)"""
    sql += """ WHERE NOT EXISTS (SELECT 1 FROM trajectory_outcomes o
                                 WHERE o.trajectory_id = CAST(:id AS uuid))
               ON CONFLICT DO NOTHING""" if as_ingested else """
               ON CONFLICT (trajectory_id) DO UPDATE SET record = EXCLUDED.record"""
    await conn.execute(text(sql), {"id": t.trajectory_id, "session": t.session_id, "key": key,
                                   "record": t.model_dump_json(exclude_none=True)})


async def forget_success(conn: AsyncConnection, trajectory_id: uuid.UUID) -> None:
    """Feedback turned a success into a failure: it is no retry for others any more."""
    await conn.execute(text("DELETE FROM session_successes WHERE trajectory_id = :id"),
                       {"id": trajectory_id})


async def overturn_failure(conn: AsyncConnection, trajectory_id: uuid.UUID) -> None:
    """Feedback says a mined failure succeeded: it no longer counts (its task, if any,
    keeps its other sources)."""
    await conn.execute(text("""UPDATE failures SET status = 'overturned',
                               reason = 'feedback says it succeeded' WHERE trajectory_id = :id"""),
                       {"id": trajectory_id})


async def find_successes(conn: AsyncConnection, session_id: str, key: str, limit: int = 5
                         ) -> list[Trajectory]:
    """The newest successes of this request in the session (newest first)."""
    rows = (await conn.execute(text("""
        SELECT record FROM session_successes WHERE session_id = :s AND request_key = :k
        ORDER BY coalesce(record->>'ended_at', record->>'started_at') DESC NULLS LAST
        LIMIT :n"""),
        {"s": session_id, "k": key, "n": limit})).scalars()
    return [Trajectory.model_validate(r) for r in rows]


async def unverified_failures(conn: AsyncConnection, session_id: str, key: str
                              ) -> list[tuple[Trajectory, str]]:
    rows = (await conn.execute(text("""
        SELECT record, failure_mode FROM failures
        WHERE session_id = :s AND request_key = :k AND status = 'unverifiable'
        FOR UPDATE"""), {"s": session_id, "k": key})).all()
    return [(Trajectory.model_validate(r), mode) for r, mode in rows]


async def claim_failure(conn: AsyncConnection, t: Trajectory, key: str | None,
                        c: Classification, *, refresh: bool = False) -> bool:
    """Insert the failure row; False when this trajectory was already mined (redelivery) or
    feedback has given it another outcome since. `refresh`: the trajectory with its feedback
    applied, which replaces what an earlier mining stored; True when the row is new."""
    params = {"id": t.trajectory_id, "agent": t.agent, "session": t.session_id, "key": key,
              "mode": c.mode, "evidence": _json(c.evidence),
              "record": t.model_dump_json(exclude_none=True)}
    if not refresh:
        res = await conn.execute(text("""
            INSERT INTO failures (trajectory_id, agent, session_id, request_key, failure_mode,
                                  evidence, status, record)
            SELECT CAST(:id AS uuid), CAST(:agent AS text), CAST(:session AS text),
                   CAST(:key AS text), CAST(:mode AS text), CAST(:evidence AS jsonb), 'pending',
                   CAST(:record AS jsonb)
            WHERE NOT EXISTS (SELECT 1 FROM trajectory_outcomes o
                              WHERE o.trajectory_id = CAST(:id AS uuid))
            ON CONFLICT (trajectory_id) DO NOTHING RETURNING 1"""), params)
        return res.scalar() is not None
    res = await conn.execute(text("""
        INSERT INTO failures (trajectory_id, agent, session_id, request_key, failure_mode,
                              evidence, status, record)
        VALUES (:id, :agent, :session, :key, :mode, CAST(:evidence AS jsonb), 'pending',
                CAST(:record AS jsonb))
        ON CONFLICT (trajectory_id) DO UPDATE SET failure_mode = EXCLUDED.failure_mode,
            evidence = EXCLUDED.evidence, status = 'pending', reason = NULL, task_id = NULL,
            record = EXCLUDED.record
        RETURNING (xmax = 0)"""), params)
    return bool(res.scalar())


async def settle_failure(conn: AsyncConnection, trajectory_id: uuid.UUID,
                         result: TaskSpec | Unverifiable, mode: str | None = None) -> None:
    if isinstance(result, Unverifiable):
        await conn.execute(text("""UPDATE failures SET status = 'unverifiable', reason = :r
                                   WHERE trajectory_id = :id"""),
                           {"r": result.reason, "id": trajectory_id})
    else:
        await conn.execute(text("""
            UPDATE failures SET status = 'task', reason = NULL, task_id = :task,
                   failure_mode = coalesce(:mode, failure_mode)
            WHERE trajectory_id = :id"""),
            {"task": result.task_id, "id": trajectory_id, "mode": mode})


async def store_task(conn: AsyncConnection, spec: TaskSpec, source: uuid.UUID,
                     expected_from: str, topics: Topics) -> bool:
    """Insert the task (or join the existing one with this fingerprint) and its source.

    Returns True when the task is new; only then is `TaskCreated` appended.
    """
    res = await conn.execute(text("""
        INSERT INTO tasks (task_id, fingerprint, env, failure_mode, split, expected_from, spec)
        VALUES (:id, :fp, :env, :mode, :split, :src, CAST(:spec AS jsonb))
        ON CONFLICT (fingerprint) DO NOTHING RETURNING 1"""),
        {"id": spec.task_id, "fp": spec.fingerprint, "env": spec.env,
         "mode": spec.failure_mode, "split": spec.split, "src": expected_from,
         "spec": spec.model_dump_json()})
    new = res.scalar() is not None
    await conn.execute(text("""INSERT INTO task_sources (task_id, trajectory_id)
                               VALUES (:task, :traj) ON CONFLICT DO NOTHING"""),
                       {"task": spec.task_id, "traj": source})
    if new:
        event = TaskCreated(
            event_id=derived_event_id("task-created", spec.task_id),
            aggregate_id=str(spec.task_id),
            payload=TaskCreatedPayload(task_id=spec.task_id, env=spec.env,
                                       failure_mode=spec.failure_mode, split=spec.split,
                                       fingerprint=spec.fingerprint,
                                       source_trajectory_id=source, expected_from=expected_from))
        await append_events(conn, [event], topics)
    return new


async def freeze_eval_set(conn: AsyncConnection, topics: Topics) -> tuple[int, int]:
    """Freeze the current holdout tasks as the next eval-set version: (version, task count)."""
    await conn.execute(text("LOCK TABLE eval_sets IN EXCLUSIVE MODE"))
    version = int((await conn.execute(text(
        "SELECT coalesce(max(version), 0) + 1 FROM eval_sets"))).scalar_one())
    ids = list((await conn.execute(text(
        "SELECT task_id FROM tasks WHERE split = 'holdout' ORDER BY task_id"))).scalars())
    await conn.execute(text("INSERT INTO eval_sets (version, task_count) VALUES (:v, :n)"),
                       {"v": version, "n": len(ids)})
    if ids:
        await conn.execute(text("""INSERT INTO eval_set_tasks (version, task_id)
                                   SELECT :v, unnest(CAST(:ids AS uuid[]))"""),
                           {"v": version, "ids": ids})
    event = EvalSetFrozen(event_id=derived_event_id("evalset", version),
                          aggregate_id=f"evalset/{version}",
                          payload=EvalSetFrozenPayload(version=version, task_ids=ids))
    await append_events(conn, [event], topics)
    return version, len(ids)


class HoldoutRefused(PermanentError, ValueError):
    pass


async def training_tasks(conn: AsyncConnection, *, env: str | None = None, limit: int = 100,
                         task_ids: list[uuid.UUID] | None = None) -> list[TaskSpec]:
    """Tasks a trainer may use. Asking for a holdout or validation task by id is an error,
    never silent."""
    if task_ids is not None:
        held = list((await conn.execute(text("""
            SELECT task_id FROM tasks WHERE task_id = ANY(CAST(:ids AS uuid[]))
              AND (split = 'holdout' OR task_id IN (SELECT task_id FROM eval_set_tasks)
                   OR task_id IN (SELECT task_id FROM validation_tasks))"""),
            {"ids": task_ids})).scalars())
        if held:
            raise HoldoutRefused(f"{len(held)} of the requested tasks are held out for "
                                 f"evaluation or validation and may never be trained on: "
                                 f"{held[:5]}")
    rows = (await conn.execute(text("""
        SELECT spec FROM tasks
        WHERE split = 'train' AND task_id NOT IN (SELECT task_id FROM eval_set_tasks)
          AND task_id NOT IN (SELECT task_id FROM validation_tasks)
          AND (CAST(:env AS text) IS NULL OR env = :env)
          AND (CAST(:ids AS uuid[]) IS NULL OR task_id = ANY(CAST(:ids AS uuid[])))
        ORDER BY created_at, task_id LIMIT :limit"""),
        {"env": env, "ids": task_ids, "limit": limit})).scalars()
    return [TaskSpec.model_validate(r) for r in rows]


def _json(value: Any) -> str:
    """JSON for a jsonb column: NaN/Infinity (jsonb refuses them) are stored as strings."""
    text_ = json.dumps(value, default=str)
    return json.dumps(json.loads(text_, parse_constant=lambda c: c))
