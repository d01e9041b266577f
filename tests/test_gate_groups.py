"""Each task group's paired comparison in the decision record (`flywheel.gate.groups`): the
pairs, the interval over tasks, McNemar and Holm, cut to what the test looked at, and shown
by `promotions show` and the report (no model, no services)."""

from __future__ import annotations

import math

import pytest

from flywheel.cli.review import group_lines
from flywheel.config import GateSettings, Settings
from flywheel.gate.candidate import decision_payload
from flywheel.gate.decision import Attempt, EvalRun, decide
from flywheel.gate.groups import exact_mcnemar, group_tests, holm
from flywheel.gate.report import report_markdown

STEP = ["env:tool_call", "mode:wrong_tool"]
EPISODE = ["env:toolset", "mode:incomplete", "kind:episode"]


def _run(version: int | None, outcomes: dict[str, list[bool]],
         groups: dict[str, list[str]]) -> EvalRun:
    return EvalRun(version, groups, [
        Attempt(task=t, index=j, success=ok, reward=float(ok), invalid=False, unsafe=False,
                latency_ms=10.0, tokens=5)
        for t, flags in outcomes.items() for j, ok in enumerate(flags)])


def _mixed() -> tuple[EvalRun, EvalRun]:
    """10 single steps, both sides alike; 20 episodes × 2 samples: the candidate wins a pair
    on 8 of them and loses one on one."""
    groups = {**{f"s{i}": STEP for i in range(10)}, **{f"e{i}": EPISODE for i in range(20)}}
    base = {**{f"s{i}": [i < 5, False] for i in range(10)},
            **{f"e{i}": [i == 19, False] for i in range(20)}}
    cand = {**{f"s{i}": [i < 5, False] for i in range(10)},
            **{f"e{i}": [False, i < 8] for i in range(20)}}
    return _run(1, cand, groups), _run(None, base, groups)


def test_each_group_gets_its_pairs_its_interval_over_tasks_and_mcnemar() -> None:
    cand, base = _mixed()
    tests = group_tests(cand, base)

    assert set(tests) == {"env:tool_call", "mode:wrong_tool", "env:toolset",
                          "mode:incomplete", "kind:episode"}
    ep = tests["kind:episode"]
    assert (ep.tasks, ep.pairs, ep.wins, ep.losses, ep.ties) == (20, 40, 8, 1, 31)
    assert ep.gain == pytest.approx(7 / 40)
    # P(X ≥ 8), X ~ Binomial(9, ½) = (9 + 1) / 512.
    assert ep.p_value == pytest.approx(10 / 512)
    assert ep.ci_low is not None and ep.ci_high is not None
    assert 0 < ep.ci_low < ep.gain < ep.ci_high < 0.5
    # Nothing changed on the single steps: no discordant pair, p 1, an interval of 0.
    step = tests["env:tool_call"]
    assert (step.pairs, step.wins, step.losses, step.gain) == (20, 0, 0, 0.0)
    assert step.p_value == 1.0 and step.ci_low == step.ci_high == 0.0
    # Holm over the five groups: the three episode groups share p = 10/512; the smallest
    # is multiplied by 5, the next by 4 and 3 but kept monotone.
    assert ep.p_holm == pytest.approx(5 * 10 / 512)
    assert tests["env:toolset"].p_holm == pytest.approx(5 * 10 / 512)
    assert step.p_holm == 1.0
    # Deterministic: the record is reproducible.
    assert group_tests(cand, base) == tests


def test_a_group_on_one_task_has_no_interval_and_unpaired_attempts_count_nowhere() -> None:
    groups = {"a": ["env:x", "tool:only_here"], "b": ["env:x"], "c": ["env:x"]}
    cand = _run(1, {"a": [True, True, True], "b": [True], "c": [True]}, groups)
    base = _run(None, {"a": [False, False, True], "b": [False]}, groups)  # no "c" on this side
    tests = group_tests(cand, base)
    one = tests["tool:only_here"]
    assert (one.tasks, one.pairs, one.wins) == (1, 3, 2)
    assert one.ci_low is None and one.ci_high is None
    assert tests["env:x"].tasks == 2 and tests["env:x"].pairs == 4  # "c" has no pair


def test_holm_steps_down_and_stays_monotone() -> None:
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx(
        {"a": 0.03, "c": 0.06, "b": 0.06})
    assert holm({"a": 0.6, "b": 0.7}) == {"a": 1.0, "b": 1.0}
    assert holm({}) == {}
    assert exact_mcnemar(0, 0) == 1.0 and exact_mcnemar(3, 0) == pytest.approx(1 / 8)


def test_the_record_keeps_the_groups_of_the_rounds_the_sequential_test_looked_at() -> None:
    # 40 tasks, 2 samples a round, 10 rounds planned: the candidate wins every pair of the
    # first round and (were it looked at) loses every later one.
    rule = GateSettings(min_gain=0.05, alpha=0.05, samples_per_task=20, round_samples=2)
    groups = {f"t{i}": ["env:tool_call", "kind:episode"] if i % 2 else ["env:tool_call"]
              for i in range(40)}
    cand = _run(1, {t: [j < 2 for j in range(20)] for t in groups}, groups)
    base = _run(None, {t: [j >= 2 for j in range(20)] for t in groups}, groups)
    d = decide(cand, base, rule)
    assert d.sequential is not None and d.sequential.stop == "win"
    used = d.sequential.pairs
    whole = d.group_tests["env:tool_call"]
    assert whole.pairs == used and whole.losses == 0 and whole.wins == used
    assert d.group_tests["kind:episode"].pairs == used // 2
    assert d.group_tests["kind:episode"].p_value == pytest.approx(0.5 ** (used // 2))


def test_promotions_show_and_the_report_give_each_group_in_words() -> None:
    fixed = Settings(gate=GateSettings(test="mcnemar"))
    cand, base = _mixed()
    payload = decision_payload(fixed, 2, None, 1, cand, base)
    record = payload.model_dump(mode="json")

    lines = group_lines(record)
    assert lines[0].startswith("[bold]per task group[/bold]")
    episode = next(x for x in lines if "kind:episode" in x)
    assert "40 pairs, 8 won, 1 lost, gain +0.175, 95% CI [+" in episode
    assert f"McNemar p {10 / 512:.2g}" in episode and "over its 20 tasks" in episode
    assert group_lines({"group_tests": {}}) == []  # records from before they were kept

    report = report_markdown({"evaluation_id": "e1", "state": "pending", "record": record})
    assert "## Per task group" in report
    row = next(x for x in report.splitlines() if x.startswith("| kind:episode |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:6] == ["20", "40", "8", "1", "+0.175"]
    assert math.isclose(float(cells[7]), 10 / 512, rel_tol=0.05)
