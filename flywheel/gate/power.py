"""What the gate can see: the minimum detectable gain (MDE) of an eval set at the budget.

The unit is the (task, sample) pair. Both sides sample every holdout task with the same
sample indices and seeds, and the holdout is frozen, so the question the gate answers is
"is the candidate better on these tasks?": given the tasks, the pairs are independent, and
the variance of the paired difference D = candidate − production ∈ {−1, 0, 1} is at most
the discordance p_d (the share of pairs where the sides disagree) minus the gain squared.
A per-task analysis would ask about the population the tasks came from instead; with tens
of tasks it has far less power, and growing the holdout is what answers that question.

Discordance before a candidate exists: production's own between-sample disagreement — the
chance that two of its samples of one task disagree, 2p(1 − p) averaged over tasks,
estimated without bias from its k samples per task. That is the discordance of an A/A
comparison with independent seeds; the shared seeds only lower it (a near-identical
candidate then repeats production's tokens), a candidate that changes many tasks raises
it, and during an evaluation the discordance actually observed is used. With no production
samples at all the bound 0.5 (the largest 2p(1 − p)) is assumed, and said.

The sequential test (`flywheel.gate.sequential`) bets λ = min(d / p_d, 0.9) on every pair,
d the design gain. To second order its log e-value after N pairs has mean
N(λΔ − λ²p_d/2) and standard deviation λ√(N p_d); it reaches ln(1/α) with probability
`power` (z = Φ⁻¹(power)) when

    Δ = λp_d/2 + ln(1/α)/(λN) + z·√(p_d/N)        (= d/2 + p_d·ln(1/α)/(dN) + z·√(p_d/N))

and the observed gain clears `min_gain` with that probability when Δ = min_gain + z·√(p_d/N).
The MDE is the larger of the two. It counts only the last look: earlier looks add power and
the futility stop takes some (at most `futility` at gains ≥ d), so the last look is asked
for power / (1 − futility). Simulated evaluations (`tests/test_gate_simulation.py`) promote
a gain of the MDE with probability 0.77–0.86 across 10–71 tasks and k = 4–64. The fixed
designs use the textbook paired formula (z₁₋α + z)·√(p_d/N) with the same floor.

Any rule that needs the observed gain to reach `min_gain` promotes a true gain of exactly
`min_gain` about half the time, so the MDE always exceeds `min_gain`; what an eval set is
asked to find is the design gain (2 × `min_gain` by default), and the warning says when the
MDE is above it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from statistics import NormalDist

from flywheel.config import GateSettings
from flywheel.events import GatePower

ASSUMED_DISCORDANCE = 0.5
"""Discordance assumed with no production samples: the largest 2p(1 − p)."""
BET_CAP = 0.9
"""Largest bet of the sequential test (λ < 1 keeps every factor 1 ± λ positive)."""


def z_of(p: float) -> float:
    """The standard normal quantile Φ⁻¹(p)."""
    return NormalDist().inv_cdf(p)


def bet_for(discordance: float, design_gain: float) -> float:
    """The sequential test's bet: Kelly's λ = d / p_d for the design gain d, with p_d at least
    d (a gain cannot exceed the discordance) and λ at most `BET_CAP`."""
    return min(design_gain / max(discordance, design_gain), BET_CAP)


def _z_power(rule: GateSettings) -> float:
    """z of the power the last look must have: `power`, or power / (1 − futility) for the
    sequential test (whose futility stop may take that share)."""
    if rule.test != "sequential":
        return z_of(rule.power)
    return z_of(min(rule.power / (1 - rule.futility), 0.999))


def mde(pairs: int, discordance: float, rule: GateSettings) -> float:
    """Minimum detectable gain with `pairs` (task, sample) pairs at `discordance` under
    `rule` (its test, alpha, power, min_gain and design gain). 1.0: nothing is detectable.

    A gain of Δ flips at least Δ of the pairs, so the discordance at the MDE is at least the
    MDE: when `discordance` is lower (a production that never or always succeeds has none
    of its own) the MDE is the fixed point Δ = _mde_at(max(discordance, Δ)), by bisection."""
    if pairs <= 0:
        return 1.0
    found = _mde_at(pairs, discordance, rule)
    if discordance >= found:
        return found
    lo, hi = 0.0, 1.0  # Δ − _mde_at(max(discordance, Δ)) rises with Δ
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if mid >= _mde_at(pairs, max(discordance, mid), rule) else (mid, hi)
    return hi


def _mde_at(pairs: int, discordance: float, rule: GateSettings) -> float:
    if discordance <= 0:
        return 1.0
    z, pd, n = _z_power(rule), discordance, pairs
    noise = z * math.sqrt(pd / n)
    floor = max(rule.min_gain, 0.0) + noise
    if rule.test == "sequential":
        lam = bet_for(pd, rule.target_gain)
        sig = lam * pd / 2 + math.log(1 / rule.alpha) / (lam * n) + noise
    else:
        sig = z_of(1 - rule.alpha) * math.sqrt(pd / n) + noise
    return min(1.0, max(sig, floor))


def pairs_needed(discordance: float, rule: GateSettings) -> int:
    """The fewest pairs for an MDE at or below the design gain (the inverse of `mde`; a gain
    of d means a discordance of at least d)."""
    d = rule.target_gain
    pd = max(discordance, d)
    b = _z_power(rule) * math.sqrt(pd)
    floor_room = d - max(rule.min_gain, 0.0)
    if floor_room <= 0:
        return 10**9  # min_gain alone is above the design gain
    x = floor_room / b  # x = 1/√N: the min_gain floor's bound
    if rule.test == "sequential":
        lam = bet_for(pd, d)
        c, room = math.log(1 / rule.alpha) / lam, d - lam * pd / 2
        # c ≤ 0 only for alpha ≥ 1 (a test that always passes): the noise term alone.
        x = min(x, (-b + math.sqrt(b * b + 4 * c * room)) / (2 * c) if c > 0 else room / b)
    else:
        x = min(x, d / (b + z_of(1 - rule.alpha) * math.sqrt(pd)))
    return math.ceil(1 / (x * x) - 1e-9)


def between_sample_discordance(successes: Iterable[list[bool]]) -> float | None:
    """Production's own disagreement: the mean over tasks (with ≥ 2 samples) of the unbiased
    estimate 2·s(k − s)/(k(k − 1)) of 2p(1 − p). None when no task has two samples."""
    values = [2 * sum(x) * (len(x) - sum(x)) / (len(x) * (len(x) - 1))
              for x in successes if len(x) >= 2]
    return sum(values) / len(values) if values else None


def report(rule: GateSettings, *, tasks: int, discordance: float | None, source: str,
           production_success: float | None) -> GatePower:
    """The power record of an eval set of `tasks` tasks at the budget (`samples_per_task`).
    `discordance` None: the assumed bound, said in `discordance_source`."""
    if discordance is None:
        discordance, source = ASSUMED_DISCORDANCE, (
            f"assumed {ASSUMED_DISCORDANCE} (no production samples yet: the largest "
            "between-sample disagreement 2p(1 − p))")
    k = rule.max_rounds * rule.round_samples if rule.test == "sequential" \
        else rule.samples_per_task
    pairs = tasks * k
    found = mde(pairs, discordance, rule)
    needed = pairs_needed(discordance, rule)
    warning = None
    if found > rule.target_gain + 1e-12:
        more = math.ceil(needed / max(tasks, 1))
        warning = (f"this eval set cannot see the gains it is asked to find: at {tasks} tasks "
                   f"× k = {k} it promotes a true gain of {found:+.3f} with probability "
                   f"{rule.power:.0%}, above the {rule.target_gain:+.3f} it is tuned to find "
                   f"(2 × min_gain unless design_gain is set); add holdout tasks or raise k "
                   f"(about {needed} pairs, e.g. k = {more} on {tasks} tasks)")
    return GatePower(tasks=tasks, samples_per_task=k, pairs=pairs, alpha=rule.alpha,
                     power=rule.power, min_gain=rule.min_gain, design_gain=rule.target_gain,
                     production_success=production_success, discordance=discordance,
                     discordance_source=source, mde=found, pairs_needed=needed,
                     warning=warning)
