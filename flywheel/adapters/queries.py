"""Read side of the adapter lifecycle, shared by the CLI, the API and the dashboard.

Every function returns plain JSON-ready dicts with stable keys (the `--json` contract).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection


def _plain(row: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(dict(row), default=str))
    return out


async def production(conn: AsyncConnection, policy: str) -> dict[str, Any]:
    row = (await conn.execute(text("""SELECT p.version, p.revision, p.updated_at, p.updated_by,
            s.served_name, s.version AS serving_version, s.replicas, s.switched_at
        FROM (SELECT CAST(:p AS text) AS policy) q
        LEFT JOIN production p USING (policy) LEFT JOIN serving_state s USING (policy)"""),
        {"p": policy})).mappings().one()
    return {"policy": policy, **_plain(row)}


async def list_adapters(conn: AsyncConnection, policy: str) -> list[dict[str, Any]]:
    rows = (await conn.execute(text("""SELECT a.version, a.parent_version, a.stage, a.steps,
            a.groups, a.status, a.created_at, a.evaluation_id, a.metrics,
            (a.version = p.version) AS production,
            (e.record->'candidate'->>'success_rate')::float AS holdout_success,
            (e.record->'baseline'->>'success_rate')::float AS baseline_success,
            e.recommendation, e.state AS decision
        FROM adapter_versions a
        LEFT JOIN production p ON p.policy = a.policy
        LEFT JOIN evaluations e ON e.evaluation_id = a.evaluation_id
        WHERE a.policy = :p ORDER BY a.version"""), {"p": policy})).mappings().all()
    return [{**_plain(r), "production": bool(r["production"])} for r in rows]


async def get_adapter(conn: AsyncConnection, policy: str, version: int) -> dict[str, Any] | None:
    row = (await conn.execute(text("""SELECT * FROM adapter_versions
        WHERE policy = :p AND version = :v"""), {"p": policy, "v": version})).mappings().first()
    if row is None:
        return None
    history = (await conn.execute(text("""SELECT seq, type, occurred_at, payload FROM events
        WHERE aggregate_id = :a AND type LIKE 'Adapter%' ORDER BY seq"""),
        {"a": f"{policy}@v{version}"})).mappings().all()
    evaluations = await list_evaluations(conn, policy, version=version)
    return {**_plain(row), "history": [_plain(h) for h in history],
            "evaluations": evaluations}


async def list_evaluations(conn: AsyncConnection, policy: str, *, state: str | None = None,
                           version: int | None = None) -> list[dict[str, Any]]:
    rows = (await conn.execute(text("""SELECT evaluation_id, version, baseline_version,
            eval_set_version, mode, recommendation, state, created_at, decided_by, decided_at,
            decision_reason, record->'candidate' AS candidate, record->'baseline' AS baseline,
            record->'reasons' AS reasons, (record->>'p_value')::float AS p_value,
            (record->'power'->>'mde')::float AS mde, record->'power'->>'warning' AS warning,
            record->'sequential'->>'stop' AS stop,
            (record->'sequential'->>'samples_per_task')::int AS samples_per_task,
            (record->'sequential'->>'rounds_planned')::int AS rounds_planned,
            (record->'power'->>'samples_per_task')::int AS budget_per_task,
            record->'canaries'->'checked' AS canaries_checked,
            record->'canaries'->'wrong' AS canaries_wrong,
            record->'warnings' AS warnings, record->'group_tests' AS group_tests,
            (record->'changes'->>'fixed_count')::int AS fixed,
            (record->'changes'->>'broken_count')::int AS broken
        FROM evaluations WHERE policy = :p
          AND (CAST(:s AS text) IS NULL OR state = :s)
          AND (CAST(:v AS int) IS NULL OR version = :v)
        ORDER BY created_at DESC"""), {"p": policy, "s": state, "v": version})).mappings().all()
    return [_plain(r) for r in rows]


async def get_evaluation(conn: AsyncConnection, evaluation_id: uuid.UUID
                         ) -> dict[str, Any] | None:
    row = (await conn.execute(text("SELECT * FROM evaluations WHERE evaluation_id = :id"),
                              {"id": evaluation_id})).mappings().first()
    return _plain(row) if row is not None else None


async def resolve_evaluation(conn: AsyncConnection, ref: str) -> uuid.UUID | None:
    """An evaluation by full id or unique id prefix (what `promotions ls` shows)."""
    rows = (await conn.execute(text("""SELECT evaluation_id FROM evaluations
        WHERE CAST(evaluation_id AS text) LIKE :prefix LIMIT 2"""),
        {"prefix": ref.lower() + "%"})).scalars().all()
    return rows[0] if len(rows) == 1 else None
