"""The gate's pure logic: holdout metrics of one side, the paired test, the decision rule.

No I/O. An evaluation run is a list of attempts per task, sampled in rounds with the same
task, sample index and seed on both sides; the decision compares a candidate run with the
production run on the same tasks: the sequential test (`flywheel.gate.sequential`) over the
complete rounds (`flywheel.gate.accounting`), or a fixed test over all of them, plus the
guard metrics, at the candidate's level in production's lifetime budget
(`flywheel.gate.lifetime`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

from flywheel.config import GateSettings
from flywheel.events import GateCheck, GateDecision, GateMetrics, GateSequential, LatencyProbe
from flywheel.gate import lifetime, power, sequential
from flywheel.gate.accounting import (
    REPLY_CHARS,
    Attempt,
    EvalRun,
    complete_rounds,
    failure_counts,
    failure_line,
    missing_pairs,
    rounds_seen,
)
from flywheel.gate.groups import exact_mcnemar, group_tests

__all__ = ["REPLY_CHARS", "Attempt", "EvalRun", "Rule", "decide", "exact_mcnemar", "metrics",
           "round_counts"]


Rule = GateSettings
"""The decision rule's thresholds are the gate settings (`min_gain`, `alpha`, `test`, the
tolerances): one definition, documented in `flywheel.config`."""


def _rate(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


def _p95(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def metrics(run: EvalRun) -> GateMetrics:
    a = run.attempts
    groups: dict[str, list[bool]] = {}
    for x in a:
        for g in run.task_groups.get(x.task, []):
            groups.setdefault(g, []).append(x.success)
    return GateMetrics(
        version=run.version, tasks=len(run.task_groups), samples=len(a), not_run=run.not_run,
        success_rate=_rate([x.success for x in a]),
        mean_reward=statistics.fmean([x.reward for x in a]) if a else 0.0,
        invalid_rate=_rate([x.invalid for x in a]), unsafe_rate=_rate([x.unsafe for x in a]),
        latency_mean_ms=statistics.fmean([x.latency_ms for x in a]) if a else 0.0,
        latency_p95_ms=_p95([x.latency_ms for x in a]),
        tokens_per_task=statistics.fmean([x.tokens for x in a]) if a else 0.0,
        tokens_per_turn=sum(x.tokens for x in a) / sum(max(1, x.turns) for x in a)
        if a else 0.0,
        groups={g: _rate(v) for g, v in sorted(groups.items())},
        group_samples={g: len(v) for g, v in sorted(groups.items())},
        failure_modes=failure_counts(run), not_run_kinds=dict(sorted(run.not_run_kinds.items())))


def _per_task_success(run: EvalRun) -> dict[str, float]:
    by: dict[str, list[bool]] = {}
    for x in run.attempts:
        by.setdefault(x.task, []).append(x.success)
    return {t: _rate(v) for t, v in by.items()}


def paired_bootstrap(cand: EvalRun, base: EvalRun, resamples: int, seed: int = 0
                     ) -> tuple[float, float]:
    """Mean per-task success difference and the one-sided p-value of "candidate ≤ base",
    resampling tasks (the unit both sides share) with replacement."""
    c, b = _per_task_success(cand), _per_task_success(base)
    tasks = sorted(set(c) & set(b))
    if not tasks:
        return 0.0, 1.0
    diffs = [c[t] - b[t] for t in tasks]
    observed = statistics.fmean(diffs)
    rng = random.Random(seed)
    n = len(diffs)
    at_most_zero = 0
    for _ in range(resamples):
        mean = sum(diffs[rng.randrange(n)] for _ in range(n)) / n
        at_most_zero += mean <= 0
    return observed, (at_most_zero + 1) / (resamples + 1)


def mcnemar(cand: EvalRun, base: EvalRun) -> tuple[float, float]:
    """Exact one-sided McNemar over (task, sample) pairs: statistic = wins − losses of the
    candidate among discordant pairs, p = P(X ≥ wins), X ~ Binomial(discordant, ½)."""
    b = {(x.task, x.index): x.success for x in base.attempts}
    wins = losses = 0
    for x in cand.attempts:
        other = b.get((x.task, x.index))
        if other is None or other == x.success:
            continue
        wins += x.success
        losses += other
    return float(wins - losses), exact_mcnemar(wins, losses)


def round_counts(cand: EvalRun, base: EvalRun, round_samples: int) -> list[sequential.Counts]:
    """Wins, losses and ties of the (task, sample) pairs, per round (sample index //
    `round_samples`), for the complete rounds from round 0 up to the first gap: a round
    with a pair missing on either side is never looked at, nor any after it."""
    usable = complete_rounds(cand, base, round_samples)
    b = {(x.task, x.index): x.success for x in base.attempts}
    rounds = [[0, 0, 0] for _ in range(usable)]
    for x in cand.attempts:
        r = x.index // round_samples
        if r < usable and (x.task, x.index) in b:
            other = b[(x.task, x.index)]
            rounds[r][0 if x.success > other else 1 if x.success < other else 2] += 1
    return [sequential.Counts(*w) for w in rounds]


def first_rounds(run: EvalRun, rounds: int, round_samples: int) -> EvalRun:
    """`run` cut to its first `rounds` rounds (what the test looked at)."""
    limit = rounds * round_samples
    return EvalRun(version=run.version, task_groups=run.task_groups,
                   attempts=[x for x in run.attempts if x.index < limit], not_run=run.not_run,
                   not_run_kinds=run.not_run_kinds)


def paired_discordance(counts: list[sequential.Counts]) -> float | None:
    seen = sum(counts, sequential.Counts())
    return sequential.discordance(seen) if seen.pairs else None


def _gap(cand: EvalRun, base: EvalRun, round_: int, s: int) -> str:
    c, b = missing_pairs(cand, base, round_, s)
    kinds = {**cand.not_run_kinds}
    for k, n in base.not_run_kinds.items():
        kinds[k] = kinds.get(k, 0) + n
    why = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "not sampled"
    return (f"round {round_ + 1} is incomplete: {c} candidate and {b} production attempts "
            f"could not be run after the retries ({why}); re-evaluate once the "
            f"infrastructure is back")


def looked_at(cand: EvalRun, base: EvalRun, rule: Rule, candidate_number: int = 1
              ) -> tuple[EvalRun, EvalRun]:
    """Both runs cut to the rounds the test looks at (the sequential test stops early: its
    used rounds at the candidate's level; a fixed test sees every run) — what the behaviour
    checks and "what changed" must read, without deciding twice."""
    if rule.test != "sequential":
        return cand, base
    s = rule.round_samples
    used = sequential.run(round_counts(cand, base, s),
                          lifetime.rule_for(rule, candidate_number)).used_rounds
    return first_rounds(cand, used, s), first_rounds(base, used, s)


def decide(cand: EvalRun, base: EvalRun, rule: Rule,
           probe: LatencyProbe | None = None, extra: Sequence[GateCheck] = (), *,
           candidate_number: int = 1) -> GateDecision:
    """Promote iff the gain is large enough, significant, and nothing guarded regresses.

    The test runs at the level of the `candidate_number`-th candidate against this
    production (`flywheel.gate.lifetime.rule_for`). Sequential: the runs are replayed round
    by round over their complete rounds and cut where the test stopped; the record keeps the
    rounds and the stopping reason. A test that needed a round the infrastructure could not
    complete ends `incomplete`. `probe`: paired latency probes (the latency guard then
    compares them instead of each side's own attempts). `extra`: further checks that must
    pass too (the reward-hacking checks, `flywheel.gate.hacking`)."""
    spend = lifetime.lifetime(rule, candidate_number)
    # What the eval set could see is reported at the real level, even under the override.
    seeing = lifetime.rule_for(rule.model_copy(update={"test_only_accept": False}),
                               candidate_number)
    lifetime_alpha, rule = rule.alpha, lifetime.rule_for(rule, candidate_number)
    seq: GateSequential | None = None
    s = rule.round_samples
    counts = round_counts(cand, base, s)
    gap = _gap(cand, base, len(counts), s) if rounds_seen(cand, base, s) > len(counts) \
        or cand.not_run or base.not_run else None
    incomplete: str | None = None
    if rule.test == "sequential":
        outcome = sequential.run(counts, rule)
        used = outcome.used_rounds
        cand, base = first_rounds(cand, used, s), first_rounds(base, used, s)
        counts = counts[:used]
        seen = sum(counts, sequential.Counts())
        if outcome.stop is None and gap is not None:
            incomplete = gap
        seq = GateSequential(
            rounds=outcome.rounds, rounds_planned=rule.max_rounds,
            samples_per_task=used * s, pairs=seen.pairs,
            stop="incomplete" if incomplete else outcome.stop or "budget",
            reason=incomplete or (outcome.reason if outcome.stop
                                  else f"{outcome.reason}: the runs end here"),
            e_value=outcome.e_value, threshold=1 / rule.alpha)
        statistic, p = outcome.e_value, outcome.p_value
    elif gap is not None:  # a fixed test needs all of its pairs
        incomplete = gap
        statistic, p = 0.0, 1.0
    elif rule.test == "mcnemar":
        statistic, p = mcnemar(cand, base)
    else:
        statistic, p = paired_bootstrap(cand, base, rule.bootstrap_resamples)
    mc, mb = metrics(cand), metrics(base)
    gain = mc.success_rate - mb.success_rate
    if seq is not None:
        sig = GateCheck(name="significance", passed=seq.stop == "win",
                        detail=f"sequential e-value {statistic:.3g} (needs ≥ "
                               f"{1 / rule.alpha:g} = 1/alpha at any round; p ≤ {p:.4f}); "
                               f"{seq.reason}")
    else:
        sig = GateCheck(name="significance", passed=p < rule.alpha,
                        detail=f"{rule.test} p = {p:.4f} (needs < {rule.alpha})")
    checks = [
        GateCheck(name="samples", passed=mc.samples > 0 and mb.samples > 0,
                  detail=f"{mc.samples} candidate and {mb.samples} production samples"),
        GateCheck(name="gain", passed=gain >= rule.min_gain,
                  detail=f"holdout success {mb.success_rate:.3f} → {mc.success_rate:.3f} "
                         f"({gain:+.3f}; needs ≥ {rule.min_gain:+.3f})"),
        sig,
        _upper("invalid_rate", mc.invalid_rate, mb.invalid_rate + rule.invalid_tolerance,
               mb.invalid_rate, "invalid-output rate"),
        _upper("unsafe_rate", mc.unsafe_rate, mb.unsafe_rate + rule.unsafe_tolerance,
               mb.unsafe_rate, "unsafe-action rate"),
        GateCheck(name="mean_reward", passed=mc.mean_reward >= mb.mean_reward
                  - rule.reward_tolerance,
                  detail=f"mean reward {mb.mean_reward:.3f} → {mc.mean_reward:.3f} "
                         f"(may drop at most {rule.reward_tolerance})"),
        _latency(mc, mb, probe, rule.latency_p95_ratio),
        _ratio("tokens_per_turn", mc.tokens_per_turn or 0.0, mb.tokens_per_turn or 0.0,
               rule.tokens_ratio, "tokens per assistant turn"),
    ]
    for g in sorted(set(mc.groups) & set(mb.groups)):
        if min(mc.group_samples[g], mb.group_samples[g]) < rule.group_min_samples:
            continue
        drop = mb.groups[g] - mc.groups[g]
        checks.append(GateCheck(
            name=f"group:{g}", passed=drop <= rule.group_tolerance,
            detail=f"success on {g} {mb.groups[g]:.3f} → {mc.groups[g]:.3f} "
                   f"(may drop at most {rule.group_tolerance})"))
    checks += extra
    if incomplete:
        checks.insert(0, GateCheck(name="complete", passed=False, detail=incomplete))
    failed = [c for c in checks if not c.passed]
    if incomplete:
        reasons = [f"incomplete, not decided: {incomplete}"]
    elif failed:
        reasons = [f"not promoted: {c.name} failed — {c.detail}" for c in failed]
    else:
        reasons = [f"promote: {checks[1].detail}; {checks[2].detail}; no guard metric or task "
                   "group regressed beyond its tolerance"]
    reasons.append(failure_line(mc, mb))
    if spend is None:
        reasons.append("TEST ONLY: gate.test_only_accept passed the significance and gain "
                       "checks without evidence")
    else:
        reasons.append(f"candidate {spend.candidate_number} against this production: tested "
                       f"at level {spend.level:.3g} of its lifetime alpha {spend.alpha:g} "
                       f"({spend.spent:.3g} spent so far)")
    thresholds = {k: float(getattr(rule, k)) for k in _THRESHOLDS}
    thresholds["design_gain"] = rule.target_gain
    thresholds["lifetime_alpha"] = lifetime_alpha
    observed = paired_discordance(counts)
    record = power.report(
        seeing, tasks=len(base.task_groups), discordance=observed,
        source=f"observed on this evaluation's {sum(c.pairs for c in counts)} pairs",
        production_success=mb.success_rate if mb.samples else None)
    return GateDecision(
        recommendation="incomplete" if incomplete else "reject" if failed else "promote",
        candidate=mc, baseline=mb, test=rule.test, statistic=statistic, p_value=p,
        thresholds=thresholds, checks=checks, reasons=reasons, power=record, sequential=seq,
        latency="paired_probe" if probe else "attempts", latency_probe=probe, lifetime=spend,
        group_tests=group_tests(cand, base))


_THRESHOLDS = ("min_gain", "alpha", "power", "futility", "invalid_tolerance",
               "unsafe_tolerance", "reward_tolerance", "latency_p95_ratio", "tokens_ratio",
               "group_tolerance", "group_min_samples", "samples_per_task", "round_samples")


def latency_probe(probes: Sequence[tuple[list[float], list[float]]]) -> LatencyProbe | None:
    """The paired probes of an evaluation (candidate ms, production ms per probe); None when
    no probe has attempts on both sides."""
    paired = [(c, b) for c, b in probes if c and b]
    if not paired:
        return None
    cand = [x for c, _ in paired for x in c]
    base = [x for _, b in paired for x in b]
    return LatencyProbe(pairs=len(paired), candidate_p95_ms=_p95(cand),
                        production_p95_ms=_p95(base), candidate_mean_ms=statistics.fmean(cand),
                        production_mean_ms=statistics.fmean(base))


def _latency(mc: GateMetrics, mb: GateMetrics, probe: LatencyProbe | None,
             ratio: float) -> GateCheck:
    if probe is None:
        return _ratio("latency_p95", mc.latency_p95_ms, mb.latency_p95_ms, ratio,
                      "p95 latency (ms, each side's own attempts)")
    return _ratio("latency_p95", probe.candidate_p95_ms, probe.production_p95_ms, ratio,
                  f"p95 latency (ms, {probe.pairs} paired probes)")


def _upper(name: str, value: float, limit: float, before: float, label: str) -> GateCheck:
    return GateCheck(name=name, passed=value <= limit + 1e-12,
                     detail=f"{label} {before:.3f} → {value:.3f} (limit {limit:.3f})")


def _ratio(name: str, value: float, before: float, ratio: float, label: str) -> GateCheck:
    if before <= 0:
        return GateCheck(name=name, passed=True, detail=f"{label}: no production figure")
    return GateCheck(name=name, passed=value <= before * ratio,
                     detail=f"{label} {before:.0f} → {value:.0f} (limit ×{ratio})")
