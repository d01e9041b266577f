"""The learning bench's held-out statistics, on hand-built outcomes (no model)."""

from __future__ import annotations

import pytest

from flywheel.bench.learning import fixed_tasks, paired_gain


def test_paired_gain_counts_pairs_and_brackets_the_gain() -> None:
    # 4 tasks × 2 samples. Task 0: both pairs gained; task 1: one gained, one lost;
    # tasks 2, 3: unchanged (one success each side). Gain = (2 + 0 + 0 + 0)/8 = 0.25.
    before = {(0, 0): (False, 0.0), (0, 1): (False, 0.0), (1, 0): (False, 0.0),
              (1, 1): (True, 1.0), (2, 0): (True, 1.0), (2, 1): (False, 0.5),
              (3, 0): (True, 1.0), (3, 1): (False, 0.5)}
    after = {**before, (0, 0): (True, 1.0), (0, 1): (True, 1.0), (1, 0): (True, 1.0),
             (1, 1): (False, 0.0), (9, 9): (True, 1.0)}  # (9, 9): no pair, left out
    g = paired_gain(before, after, resamples=2000)
    assert (g["pairs"], g["tasks"], g["pairs_gained"], g["pairs_lost"]) == (8, 4, 3, 1)
    assert g["discordance"] == 0.5
    assert g["gain_exact_success"] == 0.25 and g["gain_mean_reward"] == 0.25
    lo, hi = g["gain_exact_success_ci95"]
    # Resampling tasks: the per-task gains are 1, 0, 0, 0 → means in {0, .25, .5, .75, 1}.
    assert lo == 0.0 and 0.5 <= hi <= 0.75
    # Two-sided exact McNemar on 3 gained vs 1 lost: 2·P(X ≥ 3 | n = 4) = 2·5/16.
    assert g["mcnemar_p_two_sided"] == pytest.approx(0.625)
    assert paired_gain({}, after) == {"pairs": 0, "tasks": 0}


def test_heldout_requests_are_distinct_and_unseen() -> None:
    train = fixed_tasks(6)
    seen = {t.messages[0]["content"] for t in train}
    held = fixed_tasks(25, seed=2, exclude=seen)
    prompts = [t.messages[0]["content"] for t in held]
    assert len(held) == 25 and len(set(prompts)) == 25 and not seen & set(prompts)
    # Without `exclude` the draw is what it always was (the trainer bench depends on it).
    assert [t.messages for t in fixed_tasks(6)] == [t.messages for t in train]
