"""The adapter registry's shared reads: which versions a policy has, which one is production,
which ones must be kept, what the newest baseline recommended, the newest eval set.

Scalar answers for the services (gate, trainer, scheduler, serving, status); the JSON read
models operators see are in `flywheel.adapters.queries`. Reads only: no commit, no lock.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection


async def newest_version(conn: AsyncConnection, policy: str) -> int | None:
    """The highest registered adapter version of `policy` (None: nothing trained yet)."""
    version = (await conn.execute(text(
        "SELECT max(version) FROM adapter_versions WHERE policy = :p"), {"p": policy})).scalar()
    return None if version is None else int(version)


async def production_version(conn: AsyncConnection, policy: str) -> int | None:
    """The version production points at (None: the base model, or no pointer yet)."""
    version = (await conn.execute(text(
        "SELECT version FROM production WHERE policy = :p"), {"p": policy})).scalar()
    return None if version is None else int(version)


async def versions_in_use(conn: AsyncConnection, policy: str) -> set[int]:
    """Versions that must never be deleted from the store: production, every version that was
    production (a rollback target), one awaiting review or evaluation, the newest, and any
    that an outstanding rollout request still samples."""
    rows = await conn.execute(text("""
        SELECT adapter_version FROM rollout_requests WHERE status = 'requested'
          AND adapter_version IS NOT NULL
        UNION SELECT version FROM production WHERE policy = :p AND version IS NOT NULL
        UNION SELECT version FROM adapter_versions WHERE policy = :p
          AND status IN ('promoted', 'evaluated')
        UNION SELECT max(version) FROM adapter_versions WHERE policy = :p"""), {"p": policy})
    return {int(v) for v in rows.scalars() if v is not None}


async def newest_eval_set(conn: AsyncConnection) -> int | None:
    """The newest frozen eval-set version (None: none frozen yet)."""
    version = (await conn.execute(text("SELECT max(version) FROM eval_sets"))).scalar()
    return None if version is None else int(version)


async def latest_baseline(conn: AsyncConnection, policy: str,
                          eval_set_version: int | None = None) -> dict[str, Any] | None:
    """The newest baseline record of `policy` (on `eval_set_version` if given): the base
    model's holdout metrics and the recommended first stage (`flywheel.gate.baseline`)."""
    row = (await conn.execute(text("""SELECT baseline_id, record, created_at FROM baselines
        WHERE policy = :p AND (CAST(:e AS int) IS NULL OR eval_set_version = :e)
        ORDER BY created_at DESC LIMIT 1"""), {"p": policy, "e": eval_set_version})).first()
    if row is None:
        return None
    return {"baseline_id": str(row.baseline_id), "created_at": row.created_at.isoformat(),
            **row.record}


async def version_status(conn: AsyncConnection, policy: str, version: int) -> str | None:
    """`candidate`, `evaluated`, `promoted`, `rejected`, … (None: not registered)."""
    status = (await conn.execute(text("""SELECT status FROM adapter_versions
        WHERE policy = :p AND version = :v"""), {"p": policy, "v": version})).scalar()
    return None if status is None else str(status)
