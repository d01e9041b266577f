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
from typing import Any

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


# ---------------------------------------------------------------- a production's lifetime
# Continual training proposes candidate after candidate against one production; each is
# tested at its level alpha·6/(π² k²) (`flywheel.gate.lifetime`). Production's samples are
# drawn once per lifetime (the gate caches them: every candidate meets the same ones), each
# candidate's fresh. The sequential test is replayed vectorised in numpy (`_lifetimes`), and
# checked decision for decision against `sequential.run` on a share of the candidates.

LIFETIMES, CANDIDATES = 1000, 100
LIFE = GateSettings(min_gain=0.05, alpha=0.05, futility=0.1, samples_per_task=24,
                    round_samples=2)
"""k = 24 per task and side: what candidate 1's level (0.030) costs over a lone test at
alpha (k = 20 in `RULE` above) for power 0.8 at 2 × min_gain on 20 tasks."""


def _draw(np_rng: Any, runs: int, gain: float, rule: GateSettings
          ) -> tuple[Any, Any, Any]:
    """Wins, losses, ties [runs, CANDIDATES, rounds] of candidates of `gain` against one
    production per run (its samples shared by all the run's candidates)."""
    import numpy as np

    s, rounds = rule.round_samples, rule.max_rounds
    p = np_rng.beta(A, B, size=(runs, 1, 1, TASKS))
    share = gain / (1 - p).mean(axis=-1, keepdims=True)
    c = p + share * (1 - p)
    prod_fail = np_rng.binomial(s, 1 - p, size=(runs, 1, rounds, TASKS))
    shape = (runs, CANDIDATES, rounds, TASKS)
    wins = np_rng.binomial(np.broadcast_to(prod_fail, shape), np.broadcast_to(c, shape))
    losses = np_rng.binomial(np.broadcast_to(s - prod_fail, shape),
                             np.broadcast_to(1 - c, shape))
    w, lo = wins.sum(-1), losses.sum(-1)
    return w, lo, TASKS * s - w - lo


def _lifetimes(w: Any, lo: Any, t: Any, rule: GateSettings, spend: bool = True
               ) -> tuple[Any, Any]:
    """`sequential.run` over every candidate's rounds at its lifetime level (`spend`; else
    every one at alpha, as before): (promoted, pairs used), both [runs, CANDIDATES]."""
    import numpy as np

    from flywheel.gate.lifetime import level
    from flywheel.gate.power import BET_CAP

    d = rule.target_gain
    n = w + lo + t
    before = lambda x: np.cumsum(x, axis=-1) - x  # noqa: E731 — seen before each round
    bw, bl, bn = before(w), before(lo), before(n)
    pd = np.where(bn == 0, sequential.PRIOR_DISCORDANCE, (bw + bl + 1) / (bn + 2))
    lam = np.minimum(d / np.maximum(pd, d), BET_CAP)
    lam_f = np.minimum(d / (np.maximum(pd, d) + d * d), BET_CAP)
    win = np.cumsum(w * np.log1p(lam) + lo * np.log1p(-lam), axis=-1)
    loss = np.cumsum(lo * np.log1p(lam) + w * np.log1p(-lam), axis=-1)
    fut = np.cumsum(lo * np.log1p(lam_f * (1 + d)) + t * np.log1p(lam_f * d)
                    + w * np.log1p(lam_f * (d - 1)), axis=-1)
    cw, cl, cn = np.cumsum(w, -1), np.cumsum(lo, -1), np.cumsum(n, -1)
    k = np.arange(1, w.shape[1] + 1)[None, :, None]
    bar = np.log(1 / level(rule.alpha, 1)) + 2 * np.log(k) if spend \
        else np.full(k.shape, np.log(1 / rule.alpha))  # ln 1/alpha_k
    won = (win >= bar) & ((cw - cl) / cn >= rule.min_gain)
    stop = won | (loss >= bar) | (fut >= np.log(1 / rule.futility))
    stop[..., -1] = True  # the budget
    first = stop.argmax(axis=-1)
    pick = lambda x: np.take_along_axis(x, first[..., None], -1)[..., 0]  # noqa: E731
    return pick(won), pick(cn)


def _replayed(w: Any, lo: Any, t: Any, rule: GateSettings, runs: int) -> tuple[Any, Any]:
    """The same through `sequential.run` itself, for the first `runs` runs."""
    import numpy as np

    from flywheel.gate.lifetime import rule_for

    won = np.zeros((runs, w.shape[1]), dtype=bool)
    used = np.zeros((runs, w.shape[1]), dtype=int)
    for i in range(runs):
        for j in range(w.shape[1]):
            rounds = [Counts(int(a), int(b), int(c))
                      for a, b, c in zip(w[i, j], lo[i, j], t[i, j], strict=True)]
            out = sequential.run(rounds, rule_for(rule, j + 1))
            won[i, j], used[i, j] = out.stop == "win", out.rounds[-1].pairs
    return won, used


def test_a_lifetime_of_no_better_candidates_promotes_one_at_most_alpha_of_the_time() -> None:
    import numpy as np

    w, lo, t = _draw(np.random.default_rng(11), LIFETIMES, 0.0, LIFE)
    promoted, used = _lifetimes(w, lo, t, LIFE)
    ref_won, ref_used = _replayed(w, lo, t, LIFE, runs=5)  # 500 decisions, the real code
    assert (promoted[:5] == ref_won).all() and (used[:5] == ref_used).all()
    # A promotion ends the lifetime (production changes), so a lifetime has at most one
    # false promotion: their mean per 100 candidates is the chance of any.
    per_100 = promoted.any(axis=1).mean()
    lone, _ = _lifetimes(w, lo, t, LIFE, spend=False)  # every candidate at alpha
    lone_per_100 = lone.sum(axis=1).mean()
    print(f"\n{LIFETIMES} lifetimes of {CANDIDATES} no-better candidates: false promotions "
          f"per 100 candidates {per_100:.3f} with alpha-spending (alpha {LIFE.alpha}), "
          f"{lone_per_100:.2f} with every candidate at alpha; pairs per candidate "
          f"{used.mean():.0f} of {TASKS * LIFE.samples_per_task}")
    assert per_100 <= LIFE.alpha, per_100
    assert lone_per_100 > 10 * LIFE.alpha  # what the bound is for: a lone test each, ~α each


def test_a_candidate_of_twice_min_gain_is_still_promoted_with_power() -> None:
    import numpy as np

    from flywheel.gate.lifetime import rule_for

    gain = 2 * LIFE.min_gain
    rng = random.Random(12)
    first = rule_for(LIFE, 1)
    assert mde(TASKS * LIFE.samples_per_task, AA_DISCORDANCE, first) <= gain  # 0.095
    promoted = used = 0
    for _ in range(EVALS):  # the real test, at candidate 1's level
        p, c = _eval_set(rng, gain)
        out = sequential.run([_pairs(rng, p, c, LIFE.round_samples)
                              for _ in range(LIFE.max_rounds)], first)
        promoted += out.stop == "win"
        used += out.rounds[-1].pairs
    power = promoted / EVALS
    # Later candidates against the same production need more evidence (vectorised).
    w, lo, t = _draw(np.random.default_rng(13), 100, gain, LIFE)
    won, _ = _lifetimes(w, lo, t, LIFE)
    later = {k: won[:, k - 1].mean() for k in (2, 5, 10, 100)}
    print(f"\npower at gain {gain:+.2f}: candidate 1 {power:.3f} (mean {used / EVALS:.0f} "
          f"pairs of {TASKS * LIFE.samples_per_task}); "
          + ", ".join(f"candidate {k} {v:.2f}" for k, v in later.items()))
    assert power >= LIFE.power, power
    assert later[100] < later[2] <= power + 0.05
