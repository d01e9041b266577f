"""The sequential test on hand-counted rounds, and the decision it drives (no model)."""

from __future__ import annotations

import math

import pytest

from flywheel.config import GateSettings
from flywheel.events import LatencyProbe
from flywheel.gate import sequential
from flywheel.gate.decision import Attempt, EvalRun, decide, round_counts
from flywheel.gate.sequential import Counts, log_factor

RULE = GateSettings(min_gain=0.05, alpha=0.05, futility=0.1, samples_per_task=20,
                    round_samples=2)


def test_log_factor_is_the_product_of_one_plus_bet_times_outcome() -> None:
    # 3 wins, 1 loss, 6 ties at λ = 0.4: 3·ln 1.4 + ln 0.6 = 1.009417 − 0.510826.
    assert log_factor(Counts(3, 1, 6), 0.4, 0.0) == pytest.approx(0.498591, abs=1e-6)
    # Against "gain ≥ 0.1" (m = −0.1 on the mirrored pairs): ties count 1 + 0.1λ.
    assert log_factor(Counts(0, 0, 10), 0.5, -0.1) == pytest.approx(10 * math.log(1.05))


def test_a_clear_win_stops_in_round_two() -> None:
    # Round 1 bets d/p_d = 0.1/0.3: 10 wins → 10·ln(4/3) = 2.876821 < ln 20 = 2.995732.
    # Round 2 bets with p̂_d = (10 + 1)/(20 + 2) = 0.5: λ = 0.2, 2 wins add 2·ln 1.2:
    # 3.241463 ≥ ln 20, and the gain 12/40 = 0.3 ≥ min_gain → win.
    out = sequential.run([Counts(10, 0, 10), Counts(2, 0, 18), Counts(20, 0, 0)], RULE)
    assert out.stop == "win" and out.used_rounds == 2
    assert out.rounds[0].bet == pytest.approx(1 / 3)
    assert out.rounds[0].e_value == pytest.approx(math.exp(2.876821), rel=1e-5)
    assert out.rounds[1].bet == pytest.approx(0.2)
    assert out.e_value == pytest.approx(math.exp(3.241463), rel=1e-5)
    assert out.rounds[1].gain == pytest.approx(0.3)
    assert out.p_value == pytest.approx(1 / out.e_value)
    assert "clear win after 2 rounds (40 pairs)" in out.reason


def test_significant_but_below_min_gain_is_not_a_win() -> None:
    rule = RULE.model_copy(update={"min_gain": 0.5, "design_gain": 0.1, "samples_per_task": 4})
    out = sequential.run([Counts(10, 0, 10), Counts(2, 0, 18)], rule)
    assert out.stop == "budget" and out.rounds[-1].e_value >= 20
    assert "below min_gain" in out.reason


def test_a_clear_loss_is_the_mirror_image() -> None:
    # 12 losses at λ = 1/3: (4/3)^12 = 31.57 ≥ 20 (checked before futility, which also holds).
    out = sequential.run([Counts(0, 12, 8)], RULE)
    assert out.stop == "loss" and out.rounds[-1].e_loss == pytest.approx((4 / 3) ** 12)
    # 10 losses are not yet a clear loss ((4/3)^10 = 17.8), but rule out a gain of 0.1.
    assert sequential.run([Counts(0, 10, 10)], RULE).stop == "futility"


def test_all_ties_stop_for_futility() -> None:
    # Round 1: futility bet d/(p_d + d²) = 0.1/0.31 = 0.322581, 20 ties → 20·ln(1.032258)
    # = 0.634974. Round 2: p̂_d = 1/22 → at least d = 0.1 → bet 0.1/0.11 capped at 0.9:
    # 20·ln 1.09 = 1.723554; total 2.358528 ≥ ln(1/0.1) = 2.302585.
    out = sequential.run([Counts(0, 0, 20)] * 5, RULE)
    assert out.stop == "futility" and out.used_rounds == 2
    assert out.rounds[-1].e_futility == pytest.approx(math.exp(2.358528), rel=1e-5)
    assert out.rounds[-1].e_value == 1.0


def test_budget_and_more_rounds_needed() -> None:
    one = RULE.model_copy(update={"samples_per_task": 2})
    assert sequential.run([Counts(1, 0, 19)], one).stop == "budget"
    more = sequential.run([Counts(1, 0, 19)], RULE)
    assert more.stop is None and "1 of 10 rounds" in more.reason


def _runs(rounds: list[tuple[int, int, int]], n_tasks: int = 10, s: int = 2
          ) -> tuple[EvalRun, EvalRun]:
    """Candidate and production runs whose pairs give exactly `rounds` (wins, losses, ties)
    per round, spread over the tasks in order."""
    cand, base = [], []
    for r, (w, lost, t) in enumerate(rounds):
        kinds = ["w"] * w + ["l"] * lost + ["t"] * t
        assert len(kinds) == n_tasks * s
        for i, kind in enumerate(kinds):
            task, index = f"t{i % n_tasks}", r * s + i // n_tasks
            c, b = {"w": (True, False), "l": (False, True), "t": (True, True)}[kind]
            cand.append(Attempt(task, index, c, float(c), False, False, 100.0, 10))
            base.append(Attempt(task, index, b, float(b), False, False, 100.0, 10))
    groups = {f"t{i}": ["env:tool_call"] for i in range(n_tasks)}
    return EvalRun(2, groups, cand), EvalRun(1, groups, base)


def test_round_counts_pair_by_task_and_index() -> None:
    cand, base = _runs([(10, 0, 10), (2, 0, 18)])
    assert round_counts(cand, base, 2) == [Counts(10, 0, 10), Counts(2, 0, 18)]
    # Only complete rounds count: one pair the infrastructure could not run makes its round
    # unusable, and ends the usable rounds there (later ones are not looked at without it).
    one = EvalRun(1, base.task_groups, base.attempts[1:], not_run=1)
    assert round_counts(cand, one, 2) == []
    late = EvalRun(1, base.task_groups, [a for a in base.attempts if a.index != 3])
    assert round_counts(cand, late, 2) == [Counts(10, 0, 10)]
    gap = EvalRun(1, base.task_groups, [a for a in base.attempts if a.index >= 2])
    assert round_counts(cand, gap, 2) == []


def test_decide_cuts_the_runs_where_the_test_stopped_and_records_why() -> None:
    # The first candidate against a production is tested at alpha·6/π² = 0.030396
    # (ln 1/level = 3.493): 10·ln(4/3) + 4·ln 1.2 = 2.876821 + 0.729286 = 3.606107 crosses it
    # after round 2 (2 wins there, 3.241463, would cross 1/alpha but not the candidate's level).
    cand, base = _runs([(10, 0, 10), (4, 0, 16), (0, 20, 0)])  # round 3 never looked at
    d = decide(cand, base, RULE)
    assert d.recommendation == "promote", d.reasons
    assert d.sequential is not None and d.sequential.stop == "win"
    assert d.sequential.samples_per_task == 4 and d.sequential.pairs == 40
    assert d.candidate.samples == 40 and d.sequential.rounds_planned == 10
    assert d.test == "sequential" and d.statistic == pytest.approx(math.exp(3.606107), rel=1e-5)
    assert d.sequential.threshold == pytest.approx(1 / (0.05 * 6 / math.pi ** 2))
    assert d.lifetime is not None and d.lifetime.candidate_number == 1
    assert d.power is not None and d.power.pairs == 200  # 10 tasks × the budget of 20
    assert d.power.discordance == pytest.approx(15 / 42)  # (14 + 1)/(40 + 2) observed
    assert "observed" in d.power.discordance_source
    assert d.latency == "attempts" and d.thresholds["design_gain"] == pytest.approx(0.1)


def test_latency_guard_uses_the_paired_probe() -> None:
    cand, base = _runs([(10, 0, 10), (4, 0, 16)])
    slow = LatencyProbe(pairs=2, candidate_p95_ms=500.0, production_p95_ms=100.0,
                        candidate_mean_ms=450.0, production_mean_ms=90.0)
    d = decide(cand, base, RULE, probe=slow)
    assert d.latency == "paired_probe" and d.recommendation == "reject"
    assert {c.name for c in d.checks if not c.passed} == {"latency_p95"}
    # The attempts' own latencies (production's from another time) are not judged.
    even = slow.model_copy(update={"candidate_p95_ms": 150.0})
    assert decide(cand, base, RULE, probe=even).recommendation == "promote"


def test_a_missing_pair_ends_the_evaluation_incomplete_unless_the_test_already_stopped(
) -> None:
    cand, base = _runs([(1, 0, 19), (1, 0, 19), (1, 0, 19)])
    lost = EvalRun(2, cand.task_groups, [a for a in cand.attempts if (a.task, a.index) !=
                                         ("t3", 2)], not_run=1, not_run_kinds={"crash": 1})
    d = decide(lost, base, RULE)
    assert d.recommendation == "incomplete" and d.sequential is not None
    assert d.sequential.stop == "incomplete" and len(d.sequential.rounds) == 1
    assert d.reasons[0] == ("incomplete, not decided: round 2 is incomplete: 1 candidate and "
                            "0 production attempts could not be run after the retries (crash "
                            "1); re-evaluate once the infrastructure is back")
    fixed = decide(lost, base, RULE.model_copy(update={"test": "mcnemar"}))
    assert fixed.recommendation == "incomplete"  # a fixed test needs every pair
    # Production having more rounds cached than the candidate reached is no gap.
    short = EvalRun(2, cand.task_groups, [a for a in cand.attempts if a.index < 4])
    assert decide(short, base, RULE).sequential.stop == "budget"  # type: ignore[union-attr]
    # A test that stopped before the gap is decided: 10 clear wins per round.
    won, prod = _runs([(10, 0, 10), (4, 0, 16), (0, 0, 20)])
    gap = EvalRun(2, won.task_groups, [a for a in won.attempts if a.index < 4 or a.task != "t0"],
                  not_run=2)
    assert decide(gap, prod, RULE).recommendation == "promote"


@pytest.mark.parametrize("test", ["sequential", "mcnemar", "bootstrap"])
def test_the_test_only_override_promotes_and_reports_what_the_real_gate_could_see(
        test: str) -> None:
    cand, base = _runs([(1, 0, 19)])  # one win in 20 pairs: no evidence at all
    d = decide(cand, base, RULE.model_copy(update={"test": test, "test_only_accept": True}))
    assert d.recommendation == "promote" and d.lifetime is None
    assert d.reasons[-1].startswith("TEST ONLY: gate.test_only_accept")
    assert d.power is not None and d.power.alpha == pytest.approx(0.05 * 6 / math.pi ** 2)
