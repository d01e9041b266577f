"""The baseline rule that picks a policy's first stage (seeds: SFT when the format is not
followed, GRPO when it succeeds sometimes, more tasks when it never succeeds)."""

from __future__ import annotations

from flywheel.config import GateSettings
from flywheel.events import GateMetrics
from flywheel.gate.baseline import recommend


def m(success: float, invalid: float, samples: int = 100) -> GateMetrics:
    return GateMetrics(version=None, tasks=25, samples=samples, not_run=0,
                       success_rate=success, mean_reward=success, invalid_rate=invalid,
                       unsafe_rate=0.0, latency_mean_ms=1.0, latency_p95_ms=1.0,
                       tokens_per_task=10.0, groups={}, group_samples={})


G = GateSettings(baseline_invalid_threshold=0.5, baseline_success_low=0.02,
                 baseline_success_high=0.9)


def test_mostly_invalid_outputs_mean_sft_first() -> None:
    stage, reason = recommend(m(0.05, 0.8), G)
    assert stage == "sft" and "80%" in reason and "SFT" in reason


def test_sometimes_succeeding_means_grpo() -> None:
    assert recommend(m(0.3, 0.2), G)[0] == "grpo"


def test_valid_but_never_right_means_more_tasks() -> None:
    stage, reason = recommend(m(0.0, 0.1), G)
    assert stage == "more_tasks" and "easier" in reason


def test_already_solved_and_nothing_scored() -> None:
    assert recommend(m(0.95, 0.0), G)[0] == "none"
    assert recommend(m(0.0, 0.0, samples=0), G)[0] == "more_tasks"


def test_empty_and_cut_replies_count_as_not_following_the_format() -> None:
    """Every attempt counts: a base model that answers nothing on 30 of 100 attempts and
    garbles 25 more does not follow the format (55% > 50%), though only 25% are unparseable."""
    base = m(0.0, 0.25).model_copy(update={"failure_modes": {
        "invalid_format": 25, "empty": 20, "truncated": 10, "wrong_tool": 45}})
    stage, reason = recommend(base, G)
    assert stage == "sft" and "55%" in reason and "empty" in reason
    # The same attempts with the 30 answered (wrongly, in format): the format is followed.
    fine = base.model_copy(update={"failure_modes": {"invalid_format": 25, "wrong_tool": 75}})
    assert recommend(fine, G)[0] == "more_tasks"
