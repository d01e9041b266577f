"""The gate alone, simulated (no model, a few seconds, fixed seeds).

Eval sets like the real ones: 20 tasks whose production success rates are drawn from
Beta(0.4, 0.8) — mean 1/3, most tasks nearly always or nearly never solved, as on the demo's
and the BFCL holdouts. A candidate with gain g fixes a share of production's failures on
every task, g / mean(1 − p) of them. Both sides are sampled independently: no shared seeds,
the case with the most discordant pairs and so the hardest for the gate. Every evaluation
runs `sequential.run` over all its rounds, which stops at the first round with a clear
outcome — the gate looks after every round.
"""

from __future__ import annotations

import random
import statistics

from flywheel.config import GateSettings
from flywheel.gate import sequential
from flywheel.gate.decision import exact_mcnemar
from flywheel.gate.power import mde
from flywheel.gate.sequential import Counts

TASKS = 20
RULE = GateSettings(min_gain=0.05, alpha=0.05, futility=0.1, samples_per_task=20,
                    round_samples=2)
EVALS = 1000
A, B = 0.4, 0.8
AA_DISCORDANCE = 2 * A * B / ((A + B) * (A + B + 1))
"""E[2p(1 − p)] under Beta(A, B): production's between-sample disagreement, 0.2424."""


def _eval_set(rng: random.Random, gain: float) -> tuple[list[float], list[float]]:
    p = [rng.betavariate(A, B) for _ in range(TASKS)]
    share = gain / statistics.fmean(1 - x for x in p)
    return p, [x + share * (1 - x) for x in p]


def _pairs(rng: random.Random, p: list[float], c: list[float], samples: int) -> Counts:
    w = lo = t = 0
    for pt, ct in zip(p, c, strict=True):
        for _ in range(samples):
            prod, cand = rng.random() < pt, rng.random() < ct
            w, lo, t = w + (cand and not prod), lo + (prod and not cand), t + (cand == prod)
    return Counts(w, lo, t)


def _sequential(gain: float, seed: int, rule: GateSettings = RULE
                ) -> tuple[float, float, float]:
    """(promotion rate, share whose e-value ever reached 1/alpha, mean pairs used)."""
    rng = random.Random(seed)
    promoted = crossed = used = 0
    for _ in range(EVALS):
        p, c = _eval_set(rng, gain)
        rounds = [_pairs(rng, p, c, rule.round_samples) for _ in range(rule.max_rounds)]
        out = sequential.run(rounds, rule)
        promoted += out.stop == "win"
        crossed += max(r.e_value for r in out.rounds) >= 1 / rule.alpha
        used += out.rounds[-1].pairs
    return promoted / EVALS, crossed / EVALS, used / EVALS


def _fixed(gain: float, k: int, seed: int) -> float:
    """Promotion rate of the fixed design: all k at once, exact McNemar, the same floor."""
    rng = random.Random(seed)
    promoted = 0
    for _ in range(EVALS):
        p, c = _eval_set(rng, gain)
        n = _pairs(rng, p, c, k)
        gain_seen = (n.wins - n.losses) / n.pairs
        promoted += exact_mcnemar(n.wins, n.losses) < RULE.alpha and gain_seen >= RULE.min_gain
    return promoted / EVALS


def test_aa_evaluations_promote_at_most_alpha_however_often_it_looks() -> None:
    promoted, crossed, used = _sequential(0.0, seed=1)
    # Ville's inequality bounds the e-value ever reaching 1/alpha, at any of the 10 looks.
    assert crossed <= RULE.alpha, crossed
    assert promoted <= crossed
    assert used < TASKS * RULE.samples_per_task  # futility ends most A/A runs early


def test_twice_min_gain_is_promoted_with_power_at_the_budget() -> None:
    gain = 2 * RULE.min_gain
    assert mde(TASKS * RULE.samples_per_task, AA_DISCORDANCE, RULE) <= gain  # 0.098
    power, _, _ = _sequential(gain, seed=2)
    assert power >= RULE.power, power


def test_the_mde_is_where_the_power_is() -> None:
    # The formula's MDE, simulated: promoted with probability near `power` (0.8), and
    # half that gain far less often.
    at = mde(TASKS * RULE.samples_per_task, AA_DISCORDANCE, RULE)
    power, _, _ = _sequential(at, seed=3)
    assert 0.75 <= power <= 0.92, (at, power)
    assert _sequential(at / 2, seed=4)[0] < 0.4


def test_sequential_uses_fewer_samples_than_the_fixed_design_at_the_same_error_rates() -> None:
    gain = 2 * RULE.min_gain
    power, _, used_win = _sequential(gain, seed=5)
    aa, _, used_aa = _sequential(0.0, seed=6)
    # The fixed design with the fewest samples per task that is at least as powerful.
    k = next(k for k in range(4, 40) if _fixed(gain, k, seed=7) >= power)
    fixed_pairs = TASKS * k
    assert _fixed(0.0, k, seed=8) <= RULE.alpha and aa <= RULE.alpha
    assert used_aa < fixed_pairs and used_win < fixed_pairs, (used_aa, used_win, fixed_pairs)
