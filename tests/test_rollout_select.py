"""Task selection: informative tasks first, exploration share, retirement."""

from __future__ import annotations

import random
import uuid
from collections import Counter

from flywheel.rollout.select import TaskStat, fit_prior, pick_tasks, retire_reason


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


def test_a_solved_stratum_is_not_spent_blind_and_a_saturated_task_is_skipped() -> None:
    """After a warm start most format failures are solved: once a stratum's groups were
    all successes, its next fresh task ranks below a fresh task of a mixed stratum, and a
    task solved in all 8 attempts of its group is not requested again (`min_signal`)."""
    solved = [TaskStat(uuid.uuid4(), 8, 8, "tool_call|invalid_format") for _ in range(3)]
    mixed = [TaskStat(uuid.uuid4(), 8, 4, "tool_call|wrong_tool") for _ in range(2)]
    fresh_solved = [TaskStat(uuid.uuid4(), 0, 0, "tool_call|invalid_format")
                    for _ in range(10)]
    fresh_mixed = [TaskStat(uuid.uuid4(), 0, 0, "tool_call|wrong_tool") for _ in range(10)]
    pool = solved + mixed + fresh_solved + fresh_mixed
    prior = fit_prior(pool)
    assert prior.p(fresh_solved[0]) > 0.9 > 0.6 > prior.p(fresh_mixed[0]) > 0.4
    assert prior.mixed_chance(solved[0], 8) < 0.1 < prior.mixed_chance(fresh_solved[0], 8)

    rng = random.Random(3)
    counts: Counter[str] = Counter()
    kind = {s.task_id: k for k, group in (("solved", solved), ("mixed", mixed),
                                          ("fresh_solved", fresh_solved),
                                          ("fresh_mixed", fresh_mixed)) for s in group}
    for _ in range(200):
        for tid in pick_tasks(pool, 4, rng, explore_share=0.25, min_attempts=8,
                              min_signal=0.1):
            counts[kind[tid]] += 1
    assert counts["solved"] == 0
    assert counts["mixed"] == 2 * 200  # every pick's exploit share goes to the mixed tasks
    assert counts["fresh_mixed"] > 3 * counts["fresh_solved"] > 0
    # three solved tasks do not rule out the stratum's fresh ones: they fill what is left
    assert len(pick_tasks(solved + fresh_solved, 4, rng, explore_share=0.25, min_attempts=8,
                          min_signal=0.1)) == 4
    # min_signal 0: the old behaviour, whatever fits the budget is requested
    assert len(pick_tasks(solved, 4, rng, explore_share=0.25, min_attempts=8)) == 3
    assert pick_tasks(solved, 4, rng, explore_share=0.25, min_attempts=8, min_signal=0.1) == []


def test_a_stratum_shown_solved_on_many_tasks_stops_being_explored() -> None:
    """Eight tasks of a stratum each solved 8 of 8 (and mixed tasks elsewhere, so the
    pool's prior is weak): a ninth of that stratum is not worth a group; a fresh task of
    another stratum still is."""
    solved = [TaskStat(uuid.uuid4(), 8, 8, "tool_call|invalid_format") for _ in range(8)]
    mixed = [TaskStat(uuid.uuid4(), 8, k, "tool_call|wrong_tool") for k in (0, 3, 5)]
    fresh = TaskStat(uuid.uuid4(), 0, 0, "tool_call|invalid_format")
    other = TaskStat(uuid.uuid4(), 0, 0, "tool_call|bad_arguments")
    prior = fit_prior([*solved, *mixed, fresh, other])
    assert prior.mixed_chance(fresh, 8) < 0.1 < prior.mixed_chance(other, 8)
    picked = pick_tasks([*solved, *mixed, fresh, other], 8, random.Random(0),
                        explore_share=0.25, min_attempts=8, min_signal=0.1)
    assert fresh.task_id not in picked and other.task_id in picked


def test_the_prior_is_weak_when_tasks_are_each_always_or_never_solved() -> None:
    """Rates far apart beyond binomial noise: one group overrides the pooled mean."""
    bimodal = [_stat(8, 8) for _ in range(5)] + [_stat(8, 0) for _ in range(5)]
    assert fit_prior(bimodal).strength < 0.5
    alike = [_stat(16, 8) for _ in range(10)]
    assert fit_prior(alike).strength == 100.0
