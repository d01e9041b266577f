"""Reward profiling: the score distribution of a verifier over sample outputs (pure).

"Profile your reward before training": a verifier that gives everything 1.0, or nothing
above 0.1, teaches nothing. `flywheel verify profile` prints what this returns. Attempts that
did not run (`RolloutNotRun`) are counted by kind and kept out of every statistic.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from flywheel.tasks import RolloutNotRun, VerifierResult

BINS = 10


def profile_rewards(results: Sequence[VerifierResult | RolloutNotRun]) -> dict[str, Any]:
    """Count, mean, std (population), min/max, a 10-bin histogram over [0, 1], the share of
    each failure mode (`"none"` = no failure), the share of exact successes (reward 1.0 and
    no failure mode) and the mean of each reward component.

    Histogram bins are [i/10, (i+1)/10), the last one closed; rewards outside [0, 1] fall
    into the end bins.
    """
    scored = [r for r in results if isinstance(r, VerifierResult)]
    not_run = Counter(r.kind for r in results if isinstance(r, RolloutNotRun))
    rewards = [r.reward for r in scored]
    n = len(rewards)
    counts = [0] * BINS
    for reward in rewards:
        counts[min(BINS - 1, max(0, math.floor(reward * BINS)))] += 1
    mean = sum(rewards) / n if n else None
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / n) if mean is not None else None
    modes = Counter(r.failure_mode or "none" for r in scored)
    component_names = sorted({k for r in scored for k in r.reward_components})
    return {
        "count": n,
        "not_run": {"count": sum(not_run.values()), "by_kind": dict(sorted(not_run.items()))},
        "mean": mean,
        "std": std,
        "min": min(rewards) if n else None,
        "max": max(rewards) if n else None,
        "histogram": {"edges": [i / BINS for i in range(BINS + 1)], "counts": counts},
        "failure_modes": {m: c / n for m, c in sorted(modes.items())},
        "exact_success": (sum(1 for r in scored if r.reward == 1.0 and r.failure_mode is None)
                          / n if n else None),
        "components": {k: sum(r.reward_components.get(k, 0.0) for r in scored) / n
                       for k in component_names},
    }
