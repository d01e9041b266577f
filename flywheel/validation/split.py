"""The validation split: a deterministic, stratified share of the training tasks.

Strata are (failure mode, expected tool) — the groups the gate judges tasks in — so that
validation sees every kind of failure the pool has; the split's size is shared out over the
expected tools first (in proportion), then within each tool over its failure modes, so the
tool mix is the pool's (`stratum_quotas`). Within a stratum, tasks are ranked by a
hash of their fingerprint (salted: not the holdout's hash, which decided `train` vs
`holdout`), and each stratum gets its share of the total by largest remainder. Assignment is
sticky and only ever takes tasks never sampled for training, so a validation task was never
updated on, and one that was trained on never becomes a validation task; the holdout and
every frozen eval-set task are outside the pool altogether.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.config import ValidationSettings
from flywheel.tasks import TaskSpec, ToolCallSpec


@dataclass(frozen=True)
class PoolTask:
    task_id: uuid.UUID
    fingerprint: str
    stratum: str
    eligible: bool
    """Never sampled for training (no rollout request ever named it)."""


def stratum_of(task: TaskSpec) -> str:
    tool = "-"
    if isinstance(task.verifier, ToolCallSpec) and task.verifier.expected:
        tool = sorted(c.name for c in task.verifier.expected)[0]
    return f"{task.failure_mode}|{task.env}:{tool}"


def rank(fingerprint: str) -> str:
    return hashlib.sha256(f"validation/{fingerprint}".encode()).hexdigest()


def target(pool: int, cfg: ValidationSettings) -> int:
    """How many validation tasks a pool of `pool` training tasks keeps: the share, at
    least `min_tasks`; 0 while that would leave fewer than two thirds for training."""
    if cfg.share <= 0:
        return 0
    want = max(math.ceil(cfg.share * pool), cfg.min_tasks)
    return want if 3 * want <= pool else 0


def quotas(sizes: dict[str, int], total: int) -> dict[str, int]:
    """Split `total` over strata in proportion to their sizes (largest remainder; ties by
    stratum name, so the split is deterministic)."""
    n = sum(sizes.values())
    if n == 0 or total == 0:
        return dict.fromkeys(sizes, 0)
    exact = {s: total * k / n for s, k in sizes.items()}
    out = {s: math.floor(x) for s, x in exact.items()}
    for s in sorted(sizes, key=lambda s: (-(exact[s] - out[s]), s))[:total - sum(out.values())]:
        out[s] += 1
    return out


def tool_of(stratum: str) -> str:
    """The `env:tool` part of a stratum as `stratum_of` writes it."""
    return stratum.split("|", 1)[-1]


def stratum_quotas(sizes: dict[str, int], total: int) -> dict[str, int]:
    """`total` over strata: first over expected tools in proportion to their tasks, then
    each tool's share over its failure modes. One level of largest remainder over many
    small strata skews the tool mix: in a 500-log run, 17 validation tasks over 30 strata
    of 1–9 tasks gave the tool with a fifth of the pool (send_email, where 4 of the 5
    holdout attempts SFT's version failed were) one task, and validation read 1.000 at every
    version while the holdout read 0.917."""
    by_tool: dict[str, dict[str, int]] = defaultdict(dict)
    for s, n in sizes.items():
        by_tool[tool_of(s)][s] = n
    out: dict[str, int] = {}
    for tool, q in quotas({t: sum(ss.values()) for t, ss in by_tool.items()}, total).items():
        out |= quotas(by_tool[tool], q)
    return out


def choose(pool: list[PoolTask], assigned: set[uuid.UUID], cfg: ValidationSettings
           ) -> list[PoolTask]:
    """The tasks to add to the validation split (already assigned ones stay)."""
    by: dict[str, list[PoolTask]] = defaultdict(list)
    for t in pool:
        by[t.stratum].append(t)
    have = {s: sum(t.task_id in assigned for t in ts) for s, ts in by.items()}
    out: list[PoolTask] = []
    for s, q in stratum_quotas({s: len(ts) for s, ts in by.items()},
                               target(len(pool), cfg)).items():
        free = sorted((t for t in by[s] if t.task_id not in assigned and t.eligible),
                      key=lambda t: rank(t.fingerprint))
        out += free[:max(0, q - have[s])]
    return out


async def assign(conn: AsyncConnection, cfg: ValidationSettings, envs: list[str] | None = None
                 ) -> int:
    """Top the split up to its share of the current pool (run under the scheduler's lock,
    before it picks tasks); returns how many tasks were added. Cheap when nothing is due:
    the pool is read only when its target exceeds the split (once per new task or so)."""
    pool_n, have_n = (await conn.execute(text("""
        SELECT (SELECT count(*) FROM tasks t WHERE t.split = 'train'
                  AND t.task_id NOT IN (SELECT task_id FROM eval_set_tasks)
                  AND (cardinality(CAST(:envs AS text[])) = 0
                       OR t.env = ANY(CAST(:envs AS text[])))),
               (SELECT count(*) FROM validation_tasks v JOIN tasks t USING (task_id)
                WHERE cardinality(CAST(:envs AS text[])) = 0
                   OR t.env = ANY(CAST(:envs AS text[])))"""), {"envs": envs or []})).one()
    if target(int(pool_n), cfg) <= int(have_n):
        return 0
    rows = (await conn.execute(text("""
        SELECT t.task_id, t.fingerprint, t.spec,
               NOT EXISTS (SELECT 1 FROM rollout_requests r WHERE r.task_id = t.task_id)
        FROM tasks t
        WHERE t.split = 'train' AND t.task_id NOT IN (SELECT task_id FROM eval_set_tasks)
          AND (cardinality(CAST(:envs AS text[])) = 0 OR t.env = ANY(CAST(:envs AS text[])))"""),
        {"envs": envs or []})).all()
    pool = [PoolTask(r[0], r[1], stratum_of(TaskSpec.model_validate(r[2])), bool(r[3]))
            for r in rows]
    assigned = set((await conn.execute(text("SELECT task_id FROM validation_tasks"))).scalars())
    new = choose(pool, assigned, cfg)
    if new:
        await conn.execute(text("""INSERT INTO validation_tasks (task_id, stratum)
            SELECT unnest(CAST(:ids AS uuid[])), unnest(CAST(:s AS text[]))
            ON CONFLICT DO NOTHING"""),
            {"ids": [t.task_id for t in new], "s": [t.stratum for t in new]})
    return len(new)


async def load_tasks(conn: AsyncConnection, envs: list[str] | None = None) -> list[TaskSpec]:
    """The validation tasks in the policy's environments, by task id."""
    rows = (await conn.execute(text("""
        SELECT t.spec FROM validation_tasks v JOIN tasks t USING (task_id)
        WHERE t.split = 'train'
          AND (cardinality(CAST(:envs AS text[])) = 0 OR t.env = ANY(CAST(:envs AS text[])))
        ORDER BY t.task_id"""), {"envs": envs or []})).scalars()
    return [TaskSpec.model_validate(r) for r in rows]
