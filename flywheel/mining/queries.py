"""Read side of mining for the CLI and API: tasks with their provenance."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

_LIST = text("""
SELECT * FROM (
  SELECT t.task_id, t.env, t.failure_mode, t.expected_from, t.created_at,
         CASE WHEN v.task_id IS NOT NULL THEN 'validation' ELSE t.split END AS split,
         (SELECT count(*) FROM task_sources s WHERE s.task_id = t.task_id) AS sources
  FROM tasks t LEFT JOIN validation_tasks v ON v.task_id = t.task_id) t
WHERE (CAST(:split AS text) IS NULL OR t.split = :split)
  AND (CAST(:env AS text) IS NULL OR t.env = :env)
ORDER BY t.created_at DESC, t.task_id LIMIT :limit
""")


async def list_tasks(conn: AsyncConnection, *, split: str | None = None, env: str | None = None,
                     limit: int = 50) -> list[dict[str, Any]]:
    rows = (await conn.execute(_LIST, {"split": split, "env": env, "limit": limit})).mappings()
    return [{**r, "task_id": str(r["task_id"]), "created_at": r["created_at"].isoformat()}
            for r in rows]


async def get_task(conn: AsyncConnection, task_id: uuid.UUID) -> dict[str, Any] | None:
    row = (await conn.execute(text("""
        SELECT task_id, env, failure_mode, expected_from, fingerprint, created_at, spec,
               CASE WHEN task_id IN (SELECT task_id FROM validation_tasks) THEN 'validation'
                    ELSE split END AS split
        FROM tasks WHERE task_id = :id"""), {"id": task_id})).mappings().first()
    if row is None:
        return None
    sources = [str(s) for s in (await conn.execute(text(
        "SELECT trajectory_id FROM task_sources WHERE task_id = :id ORDER BY added_at"),
        {"id": task_id})).scalars()]
    frozen = [int(v) for v in (await conn.execute(text(
        "SELECT version FROM eval_set_tasks WHERE task_id = :id ORDER BY version"),
        {"id": task_id})).scalars()]
    return {"task_id": str(row["task_id"]), "env": row["env"],
            "failure_mode": row["failure_mode"], "split": row["split"],
            "expected_from": row["expected_from"], "fingerprint": row["fingerprint"],
            "created_at": row["created_at"].isoformat(), "sources": sources,
            "eval_set_versions": frozen, "verifier": row["spec"]["verifier"],
            "messages": row["spec"]["messages"], "tools": row["spec"]["tools"]}
