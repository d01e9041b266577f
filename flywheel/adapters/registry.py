"""The adapter registry's shared reads: which versions a policy has, which one is production,
which ones must be kept, what the newest baseline recommended, the newest eval set.

Scalar answers for the services (gate, trainer, scheduler, serving, status); the JSON read
models operators see are in `flywheel.adapters.queries`. Reads only: no commit, no lock.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection


async def newest_version(conn: AsyncConnection, policy: str) -> int | None:
    """The highest registered adapter version of `policy` (None: nothing trained yet)."""
    version = (await conn.execute(text(
        "SELECT max(version) FROM adapter_versions WHERE policy = :p"), {"p": policy})).scalar()
    return None if version is None else int(version)


async def newest_candidate(conn: AsyncConnection, policy: str) -> int | None:
    """The highest version proposed to the gate (every status but `snapshot`)."""
    version = (await conn.execute(text("""SELECT max(version) FROM adapter_versions
        WHERE policy = :p AND status <> 'snapshot'"""), {"p": policy})).scalar()
    return None if version is None else int(version)


async def candidates_waiting(conn: AsyncConnection, policy: str) -> int:
    """Versions proposed to the gate and not evaluated yet (status `candidate`)."""
    return int((await conn.execute(text("""SELECT count(*) FROM adapter_versions
        WHERE policy = :p AND status = 'candidate'"""), {"p": policy})).scalar_one())


async def production_version(conn: AsyncConnection, policy: str) -> int | None:
    """The version production points at (None: the base model, or no pointer yet)."""
    version = (await conn.execute(text(
        "SELECT version FROM production WHERE policy = :p"), {"p": policy})).scalar()
    return None if version is None else int(version)


async def versions_in_use(conn: AsyncConnection, policy: str) -> set[int]:
    """Versions that must never be deleted from the store: production, every version that was
    production (a rollback target), one awaiting review or evaluation (or still waiting
    for the gate), the newest, and any that an outstanding rollout request still samples."""
    rows = await conn.execute(text("""
        SELECT adapter_version FROM rollout_requests WHERE status = 'requested'
          AND adapter_version IS NOT NULL
        UNION SELECT version FROM production WHERE policy = :p AND version IS NOT NULL
        UNION SELECT version FROM adapter_versions WHERE policy = :p
          AND status IN ('promoted', 'evaluated', 'candidate')
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


GATE_STALE_AFTER_S = 60.0
"""A gate status row older than this while busy reads as `down` (its heartbeat is 5 s)."""


async def gate_activity(conn: AsyncConnection, policy: str) -> dict[str, Any] | None:
    """What the gate of `policy` is doing (`flywheel.gate.progress`): state (`idle`,
    `baseline`, `evaluating`, or `down` when a busy gate's heartbeat is stale), candidate
    `version`, `baseline_version`, `round`/`rounds_planned`, `samples_done`/
    `samples_planned`, `elapsed_s`, `heartbeat_age_s`, `detail` and the newest eval set's
    `power` record. None: the gate never reported."""
    row = (await conn.execute(text("""SELECT state, version, baseline_version,
            eval_set_version, round, rounds_planned, samples_done, samples_planned, detail,
            power, started_at, extract(epoch FROM now() - started_at) AS elapsed_s,
            extract(epoch FROM now() - updated_at) AS heartbeat_age_s
        FROM gate_status WHERE policy = :p"""), {"p": policy})).mappings().first()
    if row is None:
        return None
    data = dict(row)
    data["started_at"] = data["started_at"].isoformat() if data["started_at"] else None
    for key in ("elapsed_s", "heartbeat_age_s"):
        data[key] = None if data[key] is None else round(float(data[key]), 1)
    if data["state"] != "idle" and (data["heartbeat_age_s"] or 0) > GATE_STALE_AFTER_S:
        data["detail"] = (f"no heartbeat for {data['heartbeat_age_s']:.0f}s while "
                          f"{data['state']} (is the gate running?)")
        data["state"] = "down"
    return data


async def gate_evaluating(conn: AsyncConnection, policy: str) -> int | None:
    """The candidate version the gate of `policy` is evaluating now (heartbeat live), else
    None: what `rollout.yield_to_gate` yields to."""
    activity = await gate_activity(conn, policy)
    if activity is None or activity["state"] != "evaluating":
        return None
    return cast(int, activity["version"])


async def selected_by(conn: AsyncConnection, policy: str, version: int) -> str:
    """How `version` became a candidate, in words (the decision record keeps it): chosen by
    the validation pass (validation tasks only, never the holdout), or proposed by the
    trainer when it published the version."""
    row = (await conn.execute(text("""SELECT s.selection, a.stage FROM adapter_versions a
        LEFT JOIN candidate_selections s USING (policy, version)
        WHERE a.policy = :p AND a.version = :v"""), {"p": policy, "v": version})).first()
    if row is None:
        return "unknown: the version is not registered"
    if row.selection is not None:
        return f"validation: {row.selection['reason']}"
    if row.stage == "sft":
        return "trainer: the SFT warm start, proposed at publication"
    return ("trainer: proposed at publication (trainer.propose_min_groups; no validation "
            "split), or by an operator")
