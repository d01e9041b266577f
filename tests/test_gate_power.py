"""The minimum detectable gain (MDE) and the power record, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from flywheel.config import GateSettings
from flywheel.gate.lifetime import rule_for
from flywheel.gate.power import (
    ASSUMED_DISCORDANCE,
    between_sample_discordance,
    mde,
    pairs_needed,
    report,
    z_of,
)

SEQ = GateSettings(min_gain=0.05, alpha=0.05, power=0.8, futility=0.1)  # sequential
FIXED = SEQ.model_copy(update={"test": "mcnemar"})


def test_normal_quantiles() -> None:
    assert z_of(0.95) == pytest.approx(1.644854, abs=1e-6)
    assert z_of(0.8) == pytest.approx(0.841621, abs=1e-6)
    assert z_of(0.8 / 0.9) == pytest.approx(1.220640, abs=1e-6)


def test_fixed_mde_is_the_textbook_paired_formula() -> None:
    # The demo's gate: 10 tasks × k = 4 = 40 pairs, discordance 0.3.
    # (z_0.95 + z_0.8)·√(0.3/40) = (1.644854 + 0.841621)·0.0866025 = 0.215335;
    # the min_gain floor 0.05 + 0.841621·0.0866025 = 0.122887 is lower.
    assert mde(40, 0.3, FIXED) == pytest.approx(0.215335, abs=1e-5)
    # Telling a 5-point gain from none takes (2.486475/0.05)²·0.3 = 742 pairs ("several
    # hundred"); promoting it also needs the observed gain ≥ 0.05, which at 742 pairs holds
    # with probability 0.8 only for gains ≥ 0.05 + 0.841621·√(0.3/742) = 0.066923.
    assert (1.644854 + 0.841621) * math.sqrt(0.3 / 742) == pytest.approx(0.05, abs=1e-4)
    assert mde(742, 0.3, FIXED) == pytest.approx(0.066923, abs=1e-5)


def test_sequential_mde_hand_computed() -> None:
    # 400 pairs, discordance 0.25, design gain d = 2 × 0.05 = 0.1: bet λ = d/p_d = 0.4;
    # the last look needs power 0.8/(1 − 0.1) = 0.8889, z = 1.220640:
    # λp_d/2 + ln(20)/(λN) + z√(p_d/N) = 0.05 + 2.995732/160 + 1.220640·0.025
    #                                  = 0.05 + 0.018723 + 0.030516 = 0.099239.
    assert mde(400, 0.25, SEQ) == pytest.approx(0.099239, abs=1e-5)
    # A gain of Δ needs a discordance of at least Δ. The demo's 40 pairs with nothing known
    # (p_d assumed 0.5, bet 0.2): 0.05 + 2.995732/8 + 1.220640·√(0.5/40) = 0.560938 > 0.5,
    # so with p_d = Δ (bet 0.1/Δ) the MDE is the fixed point of
    # Δ = 0.05 + (2.995732/4)·Δ + 1.220640·√(Δ/40): 0.947366
    # (0.05 + 0.748933·0.947366 + 1.220640·0.153896 = 0.05 + 0.709513 + 0.187852).
    assert mde(40, ASSUMED_DISCORDANCE, SEQ) == pytest.approx(0.947366, abs=1e-5)
    # Low discordance (shared seeds, a near-identical candidate, or a production that never
    # succeeds): the closed form at p_d = 0.05 would give 0.083081 > 0.05, so again p_d = Δ:
    # Δ = 0.05 + 0.299573·Δ + 0.122064·√Δ → 0.135546
    # (0.05 + 0.040606 + 0.044940).
    assert mde(100, 0.05, SEQ) == pytest.approx(0.135546, abs=1e-5)
    assert mde(100, 0.0, SEQ) == pytest.approx(0.135546, abs=1e-5)
    assert mde(0, 0.25, SEQ) == 1.0


def test_pairs_needed_inverts_the_mde() -> None:
    # Solve 7.489331·x² + 0.610320·x = 0.05 for x = 1/√N (c = ln 20/0.4, b = z·√0.25):
    # x = (−0.610320 + √(0.372491 + 1.497866))/14.978662 = 0.050543 → N = 391.22 → 392.
    n = pairs_needed(0.25, SEQ)
    assert n == 392
    assert mde(n, 0.25, SEQ) <= SEQ.target_gain < mde(n - 1, 0.25, SEQ)
    # Fixed design: the test binds: x = 0.1/((1.644854 + 0.841621)·0.5) = 0.080435 →
    # N = 154.6 → 155 (the floor only needs (0.05/(0.841621·0.5))⁻² = 70.8).
    assert pairs_needed(0.25, FIXED) == 155
    # The rule a test forcing a promotion runs under (level 1.01, `gate.test_only_accept`)
    # still has an answer: only the noise term, (0.05/(1.220640·0.5))⁻² = 148.996 → 149.
    permissive = rule_for(SEQ.model_copy(update={"test_only_accept": True}), 1)
    assert permissive.alpha > 1 and pairs_needed(0.25, permissive) == 149


def test_between_sample_discordance_is_unbiased_per_task() -> None:
    # Per task 2·s(k − s)/(k(k − 1)): 2·2·2/12 = 0.6667, 0, 2·1·1/2 = 1 → mean 0.5556.
    got = between_sample_discordance([[True, True, False, False], [True] * 4, [True, False],
                                      [True]])  # one sample: no estimate from that task
    assert got == pytest.approx(5 / 9)
    assert between_sample_discordance([[True], []]) is None


def test_report_warns_when_the_eval_set_cannot_see_the_design_gain() -> None:
    demo = SEQ.model_copy(update={"samples_per_task": 4, "round_samples": 2})
    r = report(demo, tasks=10, discordance=None, source="", production_success=None)
    assert r.pairs == 40 and r.discordance == ASSUMED_DISCORDANCE
    assert "assumed" in r.discordance_source
    assert r.mde == pytest.approx(0.947366, abs=1e-5)
    assert r.warning is not None and "cannot see the gains it is asked to find" in r.warning
    assert "add holdout tasks or raise k" in r.warning
    # pairs_needed(0.5): 0.5 → bet 0.2, c = 14.978662, b = 0.863120, room 0.05:
    # x = (−0.863120 + √(0.744976 + 2.995732))/29.957323 = 0.035750 → 782.4 → 783 pairs,
    # k = 79 on 10 tasks.
    assert r.pairs_needed == 783 and "k = 79 on 10 tasks" in r.warning
    enough = demo.model_copy(update={"samples_per_task": 40})
    ok = report(enough, tasks=10, discordance=0.25, source="production", production_success=0.3)
    assert ok.mde == pytest.approx(0.099239, abs=1e-5) and ok.warning is None
    # k is counted in whole rounds: 41 with rounds of 2 is 40 per task.
    odd = report(enough.model_copy(update={"samples_per_task": 41}), tasks=10,
                 discordance=0.25, source="", production_success=None)
    assert odd.samples_per_task == 40
