"""The gate's sequential test: e-values on paired outcomes, looked at after every round.

A round samples every holdout task `round_samples` times on both sides, with the same task,
sample index and seed; each (task, sample) pair is a win (only the candidate succeeded), a
loss (only production did) or a tie. Three e-processes run on the pairs, each a product of
factors 1 + λ(D − m) over the pairs, D = +1 / 0 / −1, with a bet λ fixed before the round:

* win, H0 "gain ≤ 0" (m = 0): grows on wins; promotion needs it ≥ 1/alpha (alpha here is
  the candidate's level, see below);
* loss, H0 "gain ≥ 0" (the mirror): grows on losses — a clear loss;
* futility, H0 "gain ≥ d" (d = the design gain): grows when the gain is below d.

Why the false-promotion rate stays ≤ alpha however often the gate looks: within a round the
bet is the same for every pair and the pairs are independent given the tasks, so under H0
the round's factor has expectation ∏_t (1 + λΔ_t)^s ≤ exp(λ·s·Σ_t Δ_t) ≤ 1 (Δ_t the gain on
task t, whose mean is ≤ 0) — the e-value is a nonnegative supermartingale at round ends, and
by Ville's inequality it ever reaches 1/alpha with probability ≤ alpha. That is why looks
happen at round ends only: mid-round, the tasks seen so far need not average to the gain.
The same argument makes the futility stop lose at most `futility` of the power at any gain
≥ d. Stopping for futility or a loss can only lower the promotion rate.

The bet is Kelly's for the design gain, λ = d / p̂_d (Wald's SPRT of "wins and losses are
even" against the design gain, on the discordant pairs), with p̂_d the discordance of the
earlier rounds' pairs ((W + L + 1)/(N + 2)) — never of the round it bets on, which keeps it
predictable. The first round bets with `PRIOR_DISCORDANCE`. With d = 2 × min_gain the bet
grows fastest when the gain is near d, but crossing 1/alpha does *not* imply an observed
gain of min_gain: the e-value only rules out "gain ≤ 0" — 11 wins, 0 losses and 989 ties
(observed gain 0.011) carry e ≥ 20 at a bet of 1/3. So a win needs both, checked separately:
the e-value at the threshold *and* the observed gain ≥ min_gain.

Across candidates, `alpha` is a lifetime bound, not a per-candidate one: the k-th candidate
evaluated against one production is run at level alpha · 6/(π² k²)
(`flywheel.gate.lifetime.rule_for`), and the levels sum to at most alpha, so the chance
that any no-better candidate is promoted over the whole life of a production stays ≤ alpha
(union bound; the simulation in tests/test_gate_simulation.py measures 0.008 false
promotions per 100 no-better candidates at alpha = 0.05, against 1.9 with alpha each).

Looks use only complete rounds (`flywheel.gate.accounting`): every attempt the model made
counts — an empty, truncated or timed-out reply is a loss for its side, never left out —
and a round the infrastructure could not complete ends the evaluation `incomplete`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flywheel.config import GateSettings
from flywheel.events import GateRound
from flywheel.gate.power import BET_CAP, bet_for

PRIOR_DISCORDANCE = 0.3
"""Discordance the first round's bet assumes (no pairs seen yet): typical of an A/A
comparison at success rates between 0.2 and 0.8 without shared seeds. Any value keeps the
test valid; a poor one only costs the first round some efficiency."""
LOG_CAP = 700.0
"""exp() of more overflows a float; an e-value of e^700 is decisive anyway."""


@dataclass(frozen=True)
class Counts:
    wins: int = 0
    losses: int = 0
    ties: int = 0

    @property
    def pairs(self) -> int:
        return self.wins + self.losses + self.ties

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.wins + other.wins, self.losses + other.losses,
                      self.ties + other.ties)


@dataclass(frozen=True)
class Outcome:
    """The test after the rounds it was given: `stop` None means "sample another round"."""

    rounds: list[GateRound]
    stop: str | None
    reason: str

    @property
    def used_rounds(self) -> int:
        return len(self.rounds)

    @property
    def e_value(self) -> float:
        return self.rounds[-1].e_value if self.rounds else 1.0

    @property
    def p_value(self) -> float:
        """Anytime-valid p-value: 1 / the largest e-value seen, capped at 1."""
        return min(1.0, 1.0 / max([r.e_value for r in self.rounds] or [1.0]))


def log_factor(c: Counts, bet: float, m: float) -> float:
    """ln ∏ (1 + λ(D − m)) over the pairs counted in `c` (D = +1 wins, −1 losses, 0 ties)."""
    total = 0.0
    for n, x in ((c.wins, 1.0), (c.ties, 0.0), (c.losses, -1.0)):
        if n:
            total += n * math.log1p(bet * (x - m))
    return total


def discordance(seen: Counts) -> float:
    """p̂_d of the pairs seen so far (smoothed; `PRIOR_DISCORDANCE` before any)."""
    if seen.pairs == 0:
        return PRIOR_DISCORDANCE
    return (seen.wins + seen.losses + 1) / (seen.pairs + 2)


def futility_bet(pd: float, design_gain: float) -> float:
    """Kelly's bet against "gain ≥ d" when the gain is 0: λ = d / (p_d + d²)."""
    return min(design_gain / (pd + design_gain ** 2), BET_CAP)


def _e(log_e: float) -> float:
    return math.exp(min(log_e, LOG_CAP))


def run(rounds: list[Counts], rule: GateSettings) -> Outcome:
    """The sequential test over `rounds` (one `Counts` per round, in order), stopping at the
    first round with a clear outcome; `stop` None when it needs more rounds than given."""
    d, alpha = rule.target_gain, rule.alpha
    win = loss = fut = 0.0
    seen = Counts()
    out: list[GateRound] = []
    for i, c in enumerate(rounds):
        pd = discordance(seen)
        lam, lam_f = bet_for(pd, d), futility_bet(max(pd, d), d)
        win += log_factor(c, lam, 0.0)
        loss += log_factor(Counts(c.losses, c.wins, c.ties), lam, 0.0)
        fut += log_factor(Counts(c.losses, c.wins, c.ties), lam_f, -d)
        seen = seen + c
        gain = (seen.wins - seen.losses) / seen.pairs if seen.pairs else 0.0
        out.append(GateRound(round=i + 1, pairs=seen.pairs, wins=seen.wins,
                             losses=seen.losses, ties=seen.ties, gain=gain, bet=lam,
                             e_value=_e(win), e_loss=_e(loss), e_futility=_e(fut)))
        where = f"after {i + 1} round{'s' if i else ''} ({seen.pairs} pairs)"
        if win >= math.log(1 / alpha) and gain >= rule.min_gain:
            return Outcome(out, "win", f"clear win {where}: e-value {_e(win):.3g} ≥ "
                           f"1/alpha = {1 / alpha:g}, gain {gain:+.3f} ≥ min_gain "
                           f"{rule.min_gain:+.3f}")
        if loss >= math.log(1 / alpha):
            return Outcome(out, "loss", f"clear loss {where}: the evidence that the "
                           f"candidate is worse reached {_e(loss):.3g} ≥ {1 / alpha:g} "
                           f"(gain {gain:+.3f})")
        if fut >= math.log(1 / rule.futility):
            return Outcome(out, "futility", f"futility {where}: the data rule out a gain of "
                           f"{d:+.3f} (e-value {_e(fut):.3g} ≥ 1/futility = "
                           f"{1 / rule.futility:g}; gain so far {gain:+.3f})")
        if i + 1 >= rule.max_rounds:
            short = (f"significant (e-value {_e(win):.3g}) but the gain {gain:+.3f} is below "
                     f"min_gain {rule.min_gain:+.3f}" if win >= math.log(1 / alpha)
                     else f"e-value {_e(win):.3g} < {1 / alpha:g}, gain {gain:+.3f}")
            return Outcome(out, "budget", f"budget spent {where} without a clear outcome: "
                           f"{short}")
    return Outcome(out, None, f"undecided after {len(out)} of {rule.max_rounds} rounds")
