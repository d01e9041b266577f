"""The trainer's repository: which groups a version consumed, and the trainer's heartbeat.

Adds and updates inside the caller's transaction; never commits.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.config import ValidationSettings


async def already_trained(conn: AsyncConnection, group_ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
    """The groups among `group_ids` already consumed (trained into a version or dropped)."""
    if not group_ids:
        return set()
    rows = await conn.execute(text("""SELECT group_id FROM rollout_groups
        WHERE group_id = ANY(CAST(:ids AS uuid[])) AND trained_at IS NOT NULL"""),
        {"ids": list(group_ids)})
    return set(rows.scalars())


async def mark_stale(conn: AsyncConnection, group_ids: Sequence[uuid.UUID]) -> None:
    """Groups dropped as too stale to train on (consumed, never trained)."""
    await conn.execute(text("""UPDATE rollout_groups SET trained_at = now(),
        consumed_as = 'stale' WHERE group_id = ANY(CAST(:ids AS uuid[]))"""),
        {"ids": list(group_ids)})


async def mark_trained(conn: AsyncConnection, group_ids: Sequence[uuid.UUID],
                       version: int) -> None:
    """Groups trained into the published `version`."""
    await conn.execute(text("""UPDATE rollout_groups SET trained_at = now(),
        consumed_as = 'trained', trained_version = :v
        WHERE group_id = ANY(CAST(:ids AS uuid[]))"""), {"v": version, "ids": list(group_ids)})


async def write_status(conn: AsyncConnection, policy: str, *, state: str, detail: str | None,
                       version: int | None, steps: int, stale_dropped: int,
                       metrics: dict[str, float]) -> None:
    """The trainer's heartbeat row (`flywheel status` reads it; a stale row means `down`)."""
    await conn.execute(text("""
        INSERT INTO trainer_status (policy, state, detail, version, steps,
                                    stale_dropped, metrics, updated_at)
        VALUES (:p, :s, :d, :v, :steps, :stale, CAST(:m AS jsonb), now())
        ON CONFLICT (policy) DO UPDATE SET state = :s, detail = :d, version = :v,
            steps = :steps, stale_dropped = :stale, metrics = CAST(:m AS jsonb),
            updated_at = now()"""),
        {"p": policy, "s": state, "d": detail, "v": version, "steps": steps,
         "stale": stale_dropped, "m": json.dumps(metrics)})


async def trainer_state(conn: AsyncConnection, policy: str) -> str | None:
    """The state the trainer last reported (None: it never started)."""
    state = (await conn.execute(text("SELECT state FROM trainer_status WHERE policy = :p"),
                                {"p": policy})).scalar()
    return None if state is None else str(state)


async def groups_since_candidate(conn: AsyncConnection, policy: str) -> int:
    """Groups trained into the snapshots published since the newest version proposed to
    the gate (what the next proposal adds on top of it; `trainer.propose_min_groups`)."""
    return int((await conn.execute(text("""SELECT coalesce(sum(groups), 0) FROM adapter_versions
        WHERE policy = :p AND status = 'snapshot' AND version > coalesce(
            (SELECT max(version) FROM adapter_versions
             WHERE policy = :p AND status <> 'snapshot'), 0)"""), {"p": policy})).scalar_one())


async def validation_selects(conn: AsyncConnection, cfg: ValidationSettings,
                             envs: Sequence[str]) -> bool:
    """Whether the validation split is in place, so that the validation pass (not the
    trainer) chooses which GRPO versions go to the gate: the very tasks the pass scores
    (`flywheel.validation.split.load_tasks`: split `train`, the policy's environments) number
    at least `min_tasks` — else the pass proposes nothing and the trainer proposes, so one of
    the two always does and never both."""
    n = (await conn.execute(text("""
        SELECT count(*) FROM validation_tasks v JOIN tasks t USING (task_id)
        WHERE t.split = 'train'
          AND (cardinality(CAST(:envs AS text[])) = 0 OR t.env = ANY(CAST(:envs AS text[])))"""),
        {"envs": list(envs)})).scalar_one()
    return int(n) >= cfg.min_tasks


async def validation_tasks_among(conn: AsyncConnection, task_ids: Sequence[uuid.UUID]
                                 ) -> set[uuid.UUID]:
    rows = (await conn.execute(text("""SELECT task_id FROM validation_tasks
        WHERE task_id = ANY(CAST(:ids AS uuid[]))"""), {"ids": list(task_ids)})).scalars()
    return set(rows)


async def mark_refused(conn: AsyncConnection, group_ids: Sequence[uuid.UUID]) -> None:
    """Groups of validation tasks: consumed, never trained."""
    await conn.execute(text("""UPDATE rollout_groups SET trained_at = now(),
        consumed_as = 'validation' WHERE group_id = ANY(CAST(:ids AS uuid[]))"""),
        {"ids": list(group_ids)})


async def overfitting(conn: AsyncConnection, policy: str) -> str | None:
    """The validation pass's overfitting alarm while it pauses sampling (None: no pause)."""
    row = (await conn.execute(text("""SELECT detail FROM validation_status
        WHERE policy = :p AND state = 'overfitting'"""), {"p": policy})).first()
    return None if row is None else str(row[0] or "overfitting")
