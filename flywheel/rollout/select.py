"""Task selection (pure): spend sampling on tasks whose next group can teach GRPO something.

A group whose attempts all succeed or all fail has zero reward variance and no GRPO signal:
it is recorded, never trained. Each task's success probability is estimated with a prior
pooled from what the pool has shown (empirical Bayes): the prior's mean is the task's
stratum (environment and failure mode: after an SFT warm start most format failures are
solved, most wrong-tool ones are not), shrunk to the pool's mean; its strength comes from
how far apart the tasks' rates are. So a task's first group is not spent blind, and one
all-success group of a task in a stratum that is always solved is enough to move on.

Tasks are weighted by p(1 − p) (a group's expected reward variance), so tasks near 50% are
sampled most; a share of requests explores tasks with too few attempts to judge; a task
whose next group would have mixed outcomes with probability under `min_signal` is not
requested (the cores go to the trainer and the gate instead): a judged task solved in every
attempt, or a fresh one of a stratum whose several tasks all were; tasks that are always or
never solved after `retire_after` attempts are retired.
"""

from __future__ import annotations

import random
import uuid
from collections import defaultdict
from dataclasses import dataclass

FLOOR = 1e-6  # a weight for Efraimidis–Spirakis keys (p at exactly 0 or 1)
DEFAULT_STRENGTH = 2.0  # the prior's strength (pseudo-attempts) before three tasks are judged
MIN_STRENGTH, MAX_STRENGTH = 0.1, 100.0
STRATUM_EVIDENCE = 5
"""Judged tasks of its stratum before a never-sampled task may be skipped unseen."""


@dataclass(frozen=True)
class TaskStat:
    task_id: uuid.UUID
    attempts: int
    successes: int
    stratum: str = ""
    """Tasks that share a prior (`env|failure_mode` from the store)."""


@dataclass(frozen=True)
class Prior:
    """Beta prior per stratum: mean `means[stratum]` (else `mean`), strength `strength`."""

    mean: float
    strength: float
    means: dict[str, float]
    judged: dict[str, int]
    """Tasks with a record, per stratum."""

    def posterior(self, stat: TaskStat) -> tuple[float, float]:
        """The task's Beta posterior (α, β)."""
        m = self.means.get(stat.stratum, self.mean)
        return (stat.successes + self.strength * m,
                stat.attempts - stat.successes + self.strength * (1 - m))

    def p(self, stat: TaskStat) -> float:
        """Posterior mean success probability of the task."""
        a, b = self.posterior(stat)
        return a / (a + b)

    def mixed_chance(self, stat: TaskStat, group_size: int) -> float:
        """The chance that the task's next group of `group_size` attempts has both outcomes
        (is trainable): 1 − P(all succeed) − P(all fail) under the Beta-binomial
        posterior predictive."""
        a, b = self.posterior(stat)
        all_ok = all_bad = 1.0
        for i in range(group_size):
            all_ok *= (a + i) / (a + b + i)
            all_bad *= (b + i) / (a + b + i)
        return max(0.0, 1.0 - all_ok - all_bad)


def fit_prior(stats: list[TaskStat]) -> Prior:
    """Empirical Bayes (method of moments): the pool's mean success rate, the strength
    from the variance of the tasks' rates beyond their binomial noise (tasks that are each
    always or never solved give a weak prior, which one group overrides), and each
    stratum's mean over its tasks, with one pseudo-task at the pool's mean."""
    judged = [s for s in stats if s.attempts > 0]
    rates = [s.successes / s.attempts for s in judged]
    mean = (sum(s.successes for s in judged) + 1) / (sum(s.attempts for s in judged) + 2)
    strength = DEFAULT_STRENGTH
    if len(judged) >= 3:
        mu = sum(rates) / len(rates)
        spread = sum((r - mu) ** 2 for r in rates) / len(rates)
        noise = sum(mu * (1 - mu) / s.attempts for s in judged) / len(judged)
        between = spread - noise
        if spread > 0 or noise > 0:  # (every rate 1.0, or every one 0: no sign of a spread)
            strength = (MAX_STRENGTH if between <= 0 else
                        min(MAX_STRENGTH, max(MIN_STRENGTH, mu * (1 - mu) / between - 1)))
    rates_of: dict[str, list[float]] = defaultdict(list)
    for s, r in zip(judged, rates, strict=True):
        rates_of[s.stratum].append(r)
    # Tasks of a stratum differ from one another: its mean is over its tasks, not its
    # attempts, with one pseudo-task at the pool's mean (after n tasks all solved, the
    # next one is not always solved with a chance of about 1/(n + 2)).
    means = {k: (sum(r) + mean) / (len(r) + 1) for k, r in rates_of.items()}
    return Prior(mean, strength, means, {k: len(r) for k, r in rates_of.items()})


def retire_reason(stat: TaskStat, retire_after: int) -> str | None:
    if stat.attempts < retire_after:
        return None
    if stat.successes == 0:
        return "never_solved"
    if stat.successes == stat.attempts:
        return "always_solved"
    return None


def _weighted_sample(items: list[TaskStat], weights: dict[uuid.UUID, float], k: int,
                     rng: random.Random) -> list[TaskStat]:
    """Without replacement, proportional to `weights` (Efraimidis–Spirakis keys)."""
    keyed = sorted(items, key=lambda s: rng.random() ** (1 / weights[s.task_id]), reverse=True)
    return keyed[:max(0, k)]


def pick_tasks(stats: list[TaskStat], k: int, rng: random.Random, *, explore_share: float,
               min_attempts: int, group_size: int = 8, min_signal: float = 0.0
               ) -> list[uuid.UUID]:
    """Up to `k` distinct task ids: explore unjudged tasks (those of mixed strata first),
    exploit informative ones, skip any whose next group is mixed with probability under
    `min_signal` (a fresh task only once `STRATUM_EVIDENCE` tasks of its stratum have a
    record)."""
    prior = fit_prior(stats)
    useful = [s for s in stats
              if min_signal <= 0 or prior.mixed_chance(s, group_size) >= min_signal
              or (s.attempts == 0 and prior.judged.get(s.stratum, 0) < STRATUM_EVIDENCE)]
    p = {s.task_id: prior.p(s) for s in useful}
    weights = {s.task_id: max(p[s.task_id] * (1 - p[s.task_id]), FLOOR) for s in useful}
    fresh = [s for s in useful if s.attempts < min_attempts]
    judged = [s for s in useful if s.attempts >= min_attempts]
    n_explore = min(len(fresh), round(k * explore_share)) if judged else min(len(fresh), k)
    picked = _weighted_sample(fresh, weights, n_explore, rng)
    picked += _weighted_sample(judged, weights, k - len(picked), rng)
    if len(picked) < k:  # not enough judged tasks: fill with more fresh ones
        rest = [s for s in fresh if s not in picked]
        picked += _weighted_sample(rest, weights, k - len(picked), rng)
    return [s.task_id for s in picked]
