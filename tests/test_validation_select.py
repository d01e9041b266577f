"""Candidates chosen by validation, and the overfitting alarm: scripted runs, version by
version, through the same `judge` the validation pass calls after each published version."""

from __future__ import annotations

from flywheel.validation.select import Score, judge, paired_gain, sign_test

TASKS = [f"t{i:02d}" for i in range(20)]


def score(version: int | None, solved: int, train: float | None = None) -> Score:
    """A version that solves the first `solved` validation tasks (greedy: one attempt)."""
    return Score(version, {t: [i < solved] for i, t in enumerate(TASKS)}, train)


def run(script: list[tuple[int, float]], production: Score, *, gate_busy_until: int = 0
        ) -> tuple[list[int], list[str]]:
    """Publish GRPO versions v2, v3, … with (tasks solved on validation, training reward);
    after each, judge as the validation pass does. A proposal is taken only while the gate
    has no candidate waiting (it is busy with an earlier one until `gate_busy_until`).
    Returns (the versions proposed, the overfitting alarms raised)."""
    curve: list[Score] = []
    proposed: list[int] = []
    alarms: list[str] = []
    last: int | None = 1  # v1: the SFT warm start, proposed by the trainer
    for n, (solved, train) in enumerate(script):
        curve.append(score(n + 2, solved, train))
        out = judge(curve, production, last_proposed=last, margin=0.02, alpha=0.2,
                    window=4, rise=0.05)
        if out.proposal is not None and n + 2 > gate_busy_until:
            proposed.append(out.proposal.version)
            last = out.proposal.version
        if out.overfitting:
            alarms.append(out.overfitting)
    return proposed, alarms


def test_training_reward_rising_with_flat_validation_proposes_nothing_and_alarms() -> None:
    production = score(1, 8)
    script = [(8, 0.37 + 0.07 * i) for i in range(8)]  # 0.37 → 0.86, validation flat
    proposed, alarms = run(script, production)
    assert proposed == []
    assert alarms, "the divergence went unnoticed"
    assert "training reward rose" in alarms[0] and "stayed at or below 0.400" in alarms[0]


def test_validation_at_its_ceiling_raises_no_alarm_unless_it_falls() -> None:
    """Seen live (500 support logs, `flywheel up` defaults): SFT solved all 17 validation
    tasks, GRPO's training reward rose 0.830 → 0.894 over v2–v5, and the alarm paused
    sampling although no version could have scored above 1.000. Flat at the ceiling is no
    sign of memorising; falling from it is."""
    production = score(1, len(TASKS))
    rising = [0.80 + 0.03 * i for i in range(6)]
    proposed, alarms = run([(len(TASKS), r) for r in rising], production)
    assert proposed == [] and alarms == []
    _, alarms = run([(len(TASKS), r) for r in rising[:4]] + [(len(TASKS) - 2, rising[4])],
                    production)
    assert alarms and "stayed at or below 1.000 (now 0.900)" in alarms[0]


def test_rising_validation_proposes_the_best_version_since_the_last_proposal() -> None:
    production = score(1, 8)
    # v2 = production; v3 one more task (p 0.5: no); v4 +4 tasks while the gate is busy;
    # v5 slightly worse than v4: once the gate is free the best since v1 is v4, not v5.
    script = [(8, 0.40), (9, 0.45), (12, 0.50), (11, 0.55)]
    proposed, alarms = run(script, production, gate_busy_until=4)
    assert proposed == [4]
    assert alarms == []
    # Without a busy gate the first version past the screen goes at once, and v5, worse
    # than the v4 just proposed, does not follow it.
    assert run(script, production)[0] == [4]


def test_the_newest_proposal_resets_what_is_considered() -> None:
    production = score(1, 8)
    script = [(12, 0.4), (12, 0.5), (15, 0.6)]
    proposed, _ = run(script, production)
    assert proposed == [2, 4]  # v3 ties v2 (already proposed); v4 is better still


def test_sign_test_and_paired_gain_by_hand() -> None:
    assert sign_test(0, 0) == 1.0
    assert sign_test(4, 0) == 1 / 16
    assert sign_test(3, 1) == 5 / 16
    a = Score(2, {"x": [True, True], "y": [False, False], "z": [True, False]})
    b = Score(1, {"x": [False, False], "y": [False, False], "z": [True, False], "w": [True]})
    pr = paired_gain(a, b)  # only the tasks both were scored on
    # Attempt pairs: x gains both of its attempts, z's pairs agree: 2 gained, 0 lost.
    assert pr.tasks == 3 and abs(pr.gain - 1 / 3) < 1e-9
    assert (pr.wins, pr.losses, pr.p_value) == (2, 0, 0.25)
    # Pairs are by sample index (same seed): a swapped order is a gain and a loss.
    c = Score(3, {"z": [False, True]})
    assert (paired_gain(c, b).wins, paired_gain(c, b).losses) == (1, 1)


def test_a_small_saturated_split_can_still_propose() -> None:
    # The seed-1 demo: 8 validation tasks × 2 attempts, production v1 fails 2 attempts of
    # one task (0.875); a version that solves everything (1.000). A sign test over tasks
    # saw 1 task won (p 0.5 > 0.3); the attempt pairs are 2 gained, none lost (p 0.25).
    tasks = [f"v{i}" for i in range(8)]
    prod = Score(1, {t: [i > 0, i > 0] for i, t in enumerate(tasks)})
    best = Score(5, {t: [True, True] for t in tasks}, 0.9)
    out = judge([best], prod, last_proposed=1, margin=0.02, alpha=0.3, window=4, rise=0.05)
    assert out.proposal is not None and out.proposal.version == 5
    assert out.proposal.paired.p_value == 0.25


def test_a_version_below_production_is_never_proposed() -> None:
    proposed, _ = run([(6, 0.5), (7, 0.6)], score(1, 8))
    assert proposed == []


def test_status_line_says_overfitting_and_the_gap() -> None:
    from flywheel.cli.review import validation_line

    newest = {"version": 7, "validation_success": 0.4, "train_reward": 0.86, "gap": 0.46}
    _, line = validation_line({"state": "overfitting", "detail": "training reward rose",
                               "tasks": 9, "newest": newest},
                              {"train": 51, "validation": 9, "holdout": 6})
    assert "9 tasks (train 51, holdout 6)" in line and "overfitting" in line
    assert "v7: validation 0.40, training reward 0.86 (gap +0.46)" in line
    _, none = validation_line({"state": "absent", "detail": None, "tasks": 0, "newest": None},
                              {})
    assert "no validation split yet" in none


def test_after_a_pause_the_alarm_watches_only_later_versions() -> None:
    production = score(1, 8)
    curve = [score(n + 2, 8, 0.37 + 0.07 * n) for n in range(6)]  # v2–v7 overfit
    assert judge(curve, production, last_proposed=1, margin=0.02, alpha=0.2, window=4,
                 rise=0.05).overfitting
    # The pause ended after v7 (new tasks came): v8 alone cannot raise it again.
    curve.append(score(8, 8, 0.9))
    again = judge(curve, production, last_proposed=1, margin=0.02, alpha=0.2, window=4,
                  rise=0.05, alarm_after=7)
    assert again.overfitting is None and [s.version for s in again.window] == [8]


def test_the_pass_samples_as_the_gate_does_unless_told_otherwise() -> None:
    from flywheel.config import Settings
    from flywheel.validation.scoring import validation_settings

    base = Settings()
    g = validation_settings(base).gate  # default: the gate's temperature, two attempts
    assert (g.temperature, g.round_samples, g.seed) == (
        base.gate.temperature, 2, base.validation.seed) and g.temperature > 0
    hot = base.model_copy(update={"gate": base.gate.model_copy(update={"temperature": 1.0})})
    assert validation_settings(hot).gate.temperature == 1.0  # follows the gate
    greedy = base.model_copy(update={"validation": base.validation.model_copy(
        update={"temperature": 0.0})})
    g = validation_settings(greedy).gate  # greedy is deterministic: one attempt
    assert (g.temperature, g.round_samples) == (0.0, 1)
    gate_greedy = base.model_copy(update={"gate": base.gate.model_copy(
        update={"temperature": 0.0})})
    assert validation_settings(gate_greedy).gate.round_samples == 1


def test_the_split_keeps_the_pools_tool_mix() -> None:
    # The pool of a 500-log run (train + validation tasks per stratum): 63 create_ticket, 29
    # get_weather, 20 send_email tasks over 30 strata. One level of largest remainder gave
    # send_email 1 of 17 validation tasks (it is 18% of the pool); tools first gives 3.
    from collections import Counter

    from flywheel.validation.split import quotas, stratum_quotas, tool_of

    modes = ["bad_arguments", "escalated", "hallucinated_tool", "incomplete",
             "invalid_format", "other", "timeout", "tool_error", "unsafe_action", "wrong_tool"]
    per_tool = {"create_ticket": [5, 9, 5, 4, 9, 11, 1, 8, 5, 6],
                "get_weather": [4, 2, 4, 2, 3, 4, 2, 3, 3, 2],
                "send_email": [1, 2, 1, 2, 2, 1, 2, 4, 2, 3]}
    sizes = {f"{m}|tool_call:{tool}": n for tool, ns in per_tool.items()
             for m, n in zip(modes, ns, strict=True)}

    def mix(q: dict[str, int]) -> dict[str, int]:
        out: Counter[str] = Counter()
        for s, n in q.items():
            out[tool_of(s)] += n
        return dict(out)

    assert mix(quotas(sizes, 17))["tool_call:send_email"] == 1  # what the run had
    new = stratum_quotas(sizes, 17)
    assert sum(new.values()) == 17 and all(new[s] <= sizes[s] for s in sizes)
    assert mix(new) == {"tool_call:create_ticket": 10, "tool_call:get_weather": 4,
                        "tool_call:send_email": 3}  # 9.6 / 4.4 / 3.0 in proportion
    assert stratum_quotas(sizes, 17) == new  # deterministic
