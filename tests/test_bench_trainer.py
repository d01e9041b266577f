"""`flywheel bench trainer`: the TRL baseline says why it is missing; the pipeline side runs."""

from __future__ import annotations

import sys

import pytest

from flywheel.bench import trainer as bench
from flywheel.bench.learning import fixed_tasks
from flywheel.rollout.loop import GroupConfig


def test_missing_trl_is_reported_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now raises ImportError
    out = bench._trl(1, fixed_tasks(1), 1, GroupConfig(group_size=2, max_tokens=4), 1e-4)
    assert "seconds" not in out
    assert out["error"].startswith(bench.TRL_MISSING)


@pytest.mark.slow
def test_pipeline_side_trains_one_version_per_step() -> None:
    out = bench.run_trainer_bench(2, batch=2, group_size=4, max_tokens=8, tasks=2,
                                  sequential=False, trl=False)
    fw = out["flywheel"]
    assert out["inflight_groups"] == 4  # the rollout worker's default
    # A step's groups are sampled together (shared forwards), not one after another.
    assert fw["sampling_waves"] < fw["groups_sampled"]
    assert out["flywheel_s"] > 0 and out["speedup_vs_trl"] is None
    assert out["flywheel_sequential_s"] is None
    assert len(fw["train_step_s"]) == 2
    assert fw["staleness"][0] == 0 and max(fw["staleness"]) <= 1
    assert out["trl"]["error"].startswith("skipped")


@pytest.mark.slow
def test_prefix_bench_times_both_paths_on_real_prompts() -> None:
    from flywheel.bench.prefix import run_prefix_bench

    out = run_prefix_bench(batch=2, group_size=2, tokens=4)
    assert out["prompt_tokens"] > 100  # the real tool_call prompt, not a stand-in
    assert out["sft_examples"] == 4
    for side in ("grpo", "sft"):
        assert out[f"{side}_full_s"] > 0 and out[f"{side}_shared_s"] > 0
        ratio = out[f"{side}_full_s"] / out[f"{side}_shared_s"]
        assert abs(out[f"{side}_speedup"] - ratio) < 0.02  # both from the unrounded times
