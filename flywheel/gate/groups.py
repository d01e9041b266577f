"""Each task group's paired comparison, for the decision record: how the candidate did on
episodes, on one tool, on one failure mode — read straight from `promotions show`.

Per group (`env:`, `mode:`, `tool:`, `kind:episode`, see `flywheel.gate.evaluate.task_groups`)
over the (task, sample) pairs the gate's test looked at: wins (only the candidate
succeeded), losses, ties, the paired gain (wins − losses) / pairs, a 95% interval for it by a
bootstrap over the group's *tasks* (the samples of one task are not independent of each
other, the tasks are), and the exact one-sided McNemar p-value of "the candidate is no
better on this group", with its Holm adjustment over every group listed.

These figures describe; they do not decide. The promotion rests on the whole holdout's test
at the candidate's level (`flywheel.gate.decision`), and each group's guard is a bound on its
drop (`group:*` checks). A group's p-value answers "is the gain *on this group* significant"
(e.g. episodes in a mixed pool); read the Holm-adjusted one when several groups are looked
at together. McNemar counts pairs as independent, which they are only across tasks, so a group
with few tasks is better read from its interval.
"""

from __future__ import annotations

import math
import random

from flywheel.events import GroupTest
from flywheel.gate.accounting import EvalRun

RESAMPLES = 2000
"""Bootstrap resamples per group (fixed seed: the record is reproducible)."""
MIN_TASKS = 2
"""A group needs pairs on this many tasks for an interval (one task has no spread)."""


def exact_mcnemar(wins: int, losses: int) -> float:
    """One-sided exact McNemar p-value: P(X ≥ wins), X ~ Binomial(wins + losses, ½)."""
    n = wins + losses
    if n == 0:
        return 1.0
    return float(sum(math.comb(n, i) for i in range(wins, n + 1)) / 2 ** n)


def _interval(tasks: list[list[int]], seed: int) -> tuple[float, float] | None:
    """95% percentile bootstrap interval of the paired gain, resampling the tasks (each
    [wins, losses, ties]) with replacement."""
    n = len(tasks)
    if n < MIN_TASKS:
        return None
    rng = random.Random(seed)
    gains = []
    for _ in range(RESAMPLES):
        drawn = rng.choices(tasks, k=n)
        gains.append(sum(t[0] - t[1] for t in drawn) / sum(sum(t) for t in drawn))
    gains.sort()
    return gains[int(0.025 * RESAMPLES)], gains[int(0.975 * RESAMPLES) - 1]


def holm(p: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment: the k-th smallest of m p-values × (m − k + 1), made
    monotone, capped at 1 (controls the family-wise error over the groups listed)."""
    order = sorted(p, key=lambda g: (p[g], g))
    m, running, out = len(order), 0.0, {}
    for k, g in enumerate(order):
        running = max(running, min(1.0, (m - k) * p[g]))
        out[g] = running
    return out


def group_tests(cand: EvalRun, base: EvalRun, seed: int = 0) -> dict[str, GroupTest]:
    """Every group with at least one pair: its paired figures (`GroupTest`), by group name."""
    b = {(x.task, x.index): x.success for x in base.attempts}
    per_task: dict[str, dict[str, list[int]]] = {}  # group → task → [wins, losses, ties]
    for x in cand.attempts:
        other = b.get((x.task, x.index))
        if other is None:
            continue
        slot = 0 if x.success > other else 1 if x.success < other else 2
        for g in cand.task_groups.get(x.task, []):
            per_task.setdefault(g, {}).setdefault(x.task, [0, 0, 0])[slot] += 1
    sums = {g: [sum(t[j] for t in tasks.values()) for j in range(3)]
            for g, tasks in per_task.items()}
    p = {g: exact_mcnemar(w, lo) for g, (w, lo, _) in sums.items()}
    adjusted = holm(p)
    out: dict[str, GroupTest] = {}
    for i, g in enumerate(sorted(sums)):
        w, lo, ti = sums[g]
        ci = _interval(list(per_task[g].values()), seed + i)
        out[g] = GroupTest(
            tasks=len(per_task[g]), pairs=w + lo + ti, wins=w, losses=lo, ties=ti,
            gain=(w - lo) / (w + lo + ti), ci_low=ci[0] if ci else None,
            ci_high=ci[1] if ci else None, p_value=p[g], p_holm=adjusted[g])
    return out


def group_line(name: str, t: GroupTest) -> str:
    """One group in words (`promotions show`, the report)."""
    ci = (f", 95% CI [{t.ci_low:+.3f}, {t.ci_high:+.3f}] over its {t.tasks} tasks"
          if t.ci_low is not None and t.ci_high is not None
          else f" ({t.tasks} task{'s' if t.tasks != 1 else ''}: no interval)")
    return (f"{name}: {t.pairs} pairs, {t.wins} won, {t.losses} lost, gain {t.gain:+.3f}{ci}; "
            f"McNemar p {t.p_value:.2g} (Holm {t.p_holm:.2g})")
