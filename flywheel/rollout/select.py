"""Task selection (pure): spend sampling on tasks the policy sometimes solves.

A group whose attempts all succeed or all fail has zero reward variance and no GRPO signal.
Tasks with enough attempts are weighted by p(1 − p) (p = success rate), so tasks near 50%
are sampled most; a share of requests explores tasks with too few attempts to judge; tasks
that are always or never solved after `retire_after` attempts are retired.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

FLOOR = 0.02  # keeps rarely/always-solved tasks in play until they are retired


@dataclass(frozen=True)
class TaskStat:
    task_id: uuid.UUID
    attempts: int
    successes: int


def retire_reason(stat: TaskStat, retire_after: int) -> str | None:
    if stat.attempts < retire_after:
        return None
    if stat.successes == 0:
        return "never_solved"
    if stat.successes == stat.attempts:
        return "always_solved"
    return None


def weight(stat: TaskStat) -> float:
    p = stat.successes / stat.attempts
    return max(p * (1 - p), FLOOR)


def _weighted_sample(items: list[TaskStat], k: int, rng: random.Random) -> list[TaskStat]:
    """Without replacement, proportional to `weight` (Efraimidis–Spirakis keys)."""
    keyed = sorted(items, key=lambda s: rng.random() ** (1 / weight(s)), reverse=True)
    return keyed[:k]


def pick_tasks(stats: list[TaskStat], k: int, rng: random.Random, *, explore_share: float,
               min_attempts: int) -> list[uuid.UUID]:
    """Up to `k` distinct task ids: explore unjudged tasks, exploit informative ones."""
    fresh = [s for s in stats if s.attempts < min_attempts]
    judged = [s for s in stats if s.attempts >= min_attempts]
    n_explore = min(len(fresh), round(k * explore_share)) if judged else min(len(fresh), k)
    picked = rng.sample(fresh, n_explore)
    picked += _weighted_sample(judged, k - len(picked), rng)
    if len(picked) < k:  # not enough judged tasks: fill with more fresh ones
        rest = [s for s in fresh if s not in picked]
        picked += rng.sample(rest, min(len(rest), k - len(picked)))
    return [s.task_id for s in picked]
