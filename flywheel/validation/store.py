"""Validation tables: runs per version, the status row, and what the curve and the pause read.

Adds and flushes in the caller's transaction; never commits.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.gate.decision import EvalRun
from flywheel.validation.select import Score


def score_of(run: EvalRun, train_reward: float | None = None) -> Score:
    success: dict[str, list[tuple[int, bool]]] = {}
    for a in run.attempts:
        success.setdefault(a.task, []).append((a.index, a.success))
    return Score(run.version, {t: [s for _, s in sorted(v)] for t, v in success.items()},
                 train_reward)


async def cached(conn: AsyncConnection, key: str) -> EvalRun | None:
    data = (await conn.execute(text("SELECT result FROM validation_runs WHERE key = :k"),
                               {"k": key})).scalar()
    return EvalRun.from_json(data) if data is not None else None


async def store_run(conn: AsyncConnection, key: str, policy: str, run: EvalRun,
                    seconds: float) -> None:
    scored = len(run.attempts)
    await conn.execute(text("""INSERT INTO validation_runs (key, policy, version, tasks,
            samples, success_rate, reward_mean, seconds, result)
        VALUES (:k, :p, :v, :t, :n, :s, :r, :sec, CAST(:res AS jsonb))
        ON CONFLICT (key) DO NOTHING"""),
        {"k": key, "p": policy, "v": run.version, "t": len(run.task_groups),
         "n": scored + run.not_run,
         "s": sum(a.success for a in run.attempts) / scored if scored else 0.0,
         "r": sum(a.reward for a in run.attempts) / scored if scored else 0.0,
         "sec": seconds, "res": json.dumps(run.to_json())})


async def train_rewards(conn: AsyncConnection, versions: list[int]) -> dict[int, float]:
    """Mean reward of the groups trained into each version (the training reward)."""
    rows = (await conn.execute(text("""SELECT trained_version, avg(reward_mean)
        FROM rollout_groups WHERE trained_version = ANY(:v) AND reward_mean IS NOT NULL
        GROUP BY 1"""), {"v": versions})).all()
    return {int(v): float(r) for v, r in rows}


async def grpo_curve(conn: AsyncConnection, policy: str) -> list[Score]:
    """Every GRPO version's newest validation run, oldest first, with its training reward."""
    rows = (await conn.execute(text("""SELECT DISTINCT ON (r.version) r.version, r.result
        FROM validation_runs r JOIN adapter_versions a
             ON a.policy = r.policy AND a.version = r.version
        WHERE r.policy = :p AND a.stage = 'grpo'
        ORDER BY r.version, r.created_at DESC"""), {"p": policy})).all()
    rewards = await train_rewards(conn, [int(r[0]) for r in rows])
    # A version with no trained group (all stale) has no training reward: not 0.
    return [score_of(EvalRun.from_json(r[1]), rewards.get(int(r[0]))) for r in rows]


async def curve_rows(conn: AsyncConnection, policy: str) -> list[dict[str, Any]]:
    """Per version: validation success (newest run), training reward and their gap — what
    the dashboard and `flywheel adapters ls` show."""
    rows = (await conn.execute(text("""SELECT DISTINCT ON (r.version) r.version,
            r.success_rate, r.tasks, r.samples, r.seconds
        FROM validation_runs r WHERE r.policy = :p AND r.version IS NOT NULL
        ORDER BY r.version, r.created_at DESC"""), {"p": policy})).mappings().all()
    rewards = await train_rewards(conn, [int(r["version"]) for r in rows])
    out = []
    for r in rows:
        train = rewards.get(int(r["version"]))
        out.append({"version": r["version"], "validation_success": r["success_rate"],
                    "validation_tasks": r["tasks"], "validation_samples": r["samples"],
                    "validation_seconds": r["seconds"], "train_reward": train,
                    "gap": None if train is None else train - r["success_rate"]})
    return out


async def status(conn: AsyncConnection, policy: str) -> dict[str, Any] | None:
    row = (await conn.execute(text("""SELECT state, detail, train_tasks, after_version,
        updated_at FROM validation_status WHERE policy = :p"""), {"p": policy})
           ).mappings().one_or_none()
    return dict(row) if row else None


async def set_status(conn: AsyncConnection, policy: str, state: str, detail: str | None, *,
                     train_tasks: int = 0, after_version: int | None = None) -> None:
    await conn.execute(text("""INSERT INTO validation_status (policy, state, detail,
            train_tasks, after_version, updated_at)
        VALUES (:p, :s, :d, :n, :a, now())
        ON CONFLICT (policy) DO UPDATE SET state = :s, detail = :d, train_tasks = :n,
            after_version = coalesce(:a, validation_status.after_version), updated_at = now()"""),
        {"p": policy, "s": state, "d": detail, "n": train_tasks, "a": after_version})


async def train_task_count(conn: AsyncConnection) -> int:
    return int((await conn.execute(text(
        "SELECT count(*) FROM tasks WHERE split = 'train'"))).scalar_one())


async def validation_count(conn: AsyncConnection) -> int:
    return int((await conn.execute(text("SELECT count(*) FROM validation_tasks"))).scalar_one())


async def paused(conn: AsyncConnection, policy: str, resume_new_tasks: int) -> bool:
    """Whether sampling is paused for overfitting; ends the pause (state `ok`, the alarm
    then looks only at later versions) once the miner added `resume_new_tasks` tasks."""
    st = await status(conn, policy)
    if st is None or st["state"] != "overfitting":
        return False
    pool = await train_task_count(conn)
    if pool < st["train_tasks"] + resume_new_tasks:
        return True
    newest = (await conn.execute(text("SELECT max(version) FROM adapter_versions WHERE "
                                      "policy = :p"), {"p": policy})).scalar()
    await set_status(conn, policy, "ok", f"resumed: the pool grew {st['train_tasks']} → "
                     f"{pool} training tasks", train_tasks=pool, after_version=newest)
    return False
