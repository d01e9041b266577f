"""Task selection: informative tasks first, exploration share, retirement."""

from __future__ import annotations

import random
import uuid
from collections import Counter

from flywheel.rollout.select import TaskStat, pick_tasks, retire_reason


def _stat(attempts: int, successes: int) -> TaskStat:
    return TaskStat(uuid.uuid4(), attempts, successes)


def test_prefers_tasks_the_policy_sometimes_solves() -> None:
    half = [_stat(16, 8) for _ in range(5)]
    never = [_stat(16, 0) for _ in range(5)]
    always = [_stat(16, 16) for _ in range(5)]
    rng = random.Random(0)
    counts: Counter[str] = Counter()
    kind = {s.task_id: k for k, group in (("half", half), ("never", never), ("always", always))
            for s in group}
    for _ in range(300):
        for tid in pick_tasks(half + never + always, 3, rng, explore_share=0.0, min_attempts=8):
            counts[kind[tid]] += 1
    # 5 informative tasks vs 10 uninformative ones, weights 0.25 vs 0.02 per task
    assert counts["half"] > 4 * (counts["never"] + counts["always"])


def test_explore_share_of_unjudged_tasks_and_distinct_picks() -> None:
    fresh = [_stat(0, 0) for _ in range(20)]
    judged = [_stat(16, 8) for _ in range(20)]
    picked = pick_tasks(fresh + judged, 8, random.Random(1), explore_share=0.25,
                        min_attempts=8)
    assert len(picked) == len(set(picked)) == 8
    assert sum(1 for t in picked if t in {s.task_id for s in fresh}) == 2


def test_fills_with_fresh_tasks_when_nothing_is_judged_yet() -> None:
    fresh = [_stat(0, 0) for _ in range(3)]
    assert len(pick_tasks(fresh, 8, random.Random(2), explore_share=0.25, min_attempts=8)) == 3


def test_retirement_after_enough_attempts() -> None:
    assert retire_reason(_stat(32, 0), 32) == "never_solved"
    assert retire_reason(_stat(40, 40), 32) == "always_solved"
    assert retire_reason(_stat(40, 39), 32) is None
    assert retire_reason(_stat(31, 0), 32) is None
