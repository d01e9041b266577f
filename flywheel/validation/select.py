"""Which version to propose, and when training has stopped generalising: pure functions.

A version's validation score is its success per validation task and sample index (fixed
seeds, so two versions' attempts pair up by task and index). The proposal screen is the
gate's exact McNemar test over those attempt pairs: the pairs on which the two versions
differ, one-sided. It is exact at any size and paired, so what both solve or both fail costs
nothing; attempts of one task are not independent, which is why the screen runs at a loose
level (`validation.alpha`, 0.2) and only spares the gate versions that show no sign of a
gain; the gate's holdout test still decides, untouched by this choice. (A sign test over
tasks could not pass on a small split: on 8 tasks where production fails one, no version
can reach p < 0.5.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flywheel.gate.decision import exact_mcnemar


@dataclass(frozen=True)
class Score:
    """One version on the validation tasks (None = the base model)."""

    version: int | None
    success: dict[str, list[bool]]
    """Per task id, success of each attempt in sample-index order."""
    train_reward: float | None = None
    """Mean reward of the groups trained into the version (None: not a GRPO version)."""

    @property
    def rate(self) -> float:
        return rate_on(self, sorted(self.success))


def rate_on(score: Score, tasks: list[str]) -> float:
    """Success rate of `score` over `tasks` (each task weighs the same)."""
    per = [sum(score.success[t]) / len(score.success[t]) for t in tasks if score.success.get(t)]
    return sum(per) / len(per) if per else 0.0


def common_tasks(a: Score, b: Score) -> list[str]:
    return sorted(t for t in a.success if a.success[t] and b.success.get(t))


sign_test = exact_mcnemar
"""One-sided p of `wins` or more among `wins + losses` fair coin flips: the gate's exact
McNemar test (`flywheel.gate.decision.exact_mcnemar`), here at the screen's loose level."""


@dataclass(frozen=True)
class Paired:
    tasks: int
    candidate: float
    production: float
    gain: float
    p_value: float
    wins: int = 0
    """Attempt pairs the candidate solved and production did not."""
    losses: int = 0


def paired_gain(candidate: Score, production: Score) -> Paired:
    """Candidate against production on the tasks both were scored on: success rates (each
    task weighs the same) and the McNemar test over their attempt pairs (same task, same
    sample index, same seed)."""
    tasks = common_tasks(candidate, production)
    c, p = rate_on(candidate, tasks), rate_on(production, tasks)
    wins = losses = 0
    for t in tasks:
        for mine, theirs in zip(candidate.success[t], production.success[t], strict=False):
            wins, losses = wins + (mine and not theirs), losses + (theirs and not mine)
    return Paired(len(tasks), c, p, c - p, sign_test(wins, losses), wins, losses)


@dataclass(frozen=True)
class Proposal:
    version: int
    paired: Paired
    considered: list[int]
    reason: str


@dataclass(frozen=True)
class Outcome:
    proposal: Proposal | None
    why_not: str | None
    """Why nothing is proposed (None when something is)."""
    overfitting: str | None = None
    """The alarm in words (None: no divergence)."""
    best: int | None = None
    window: list[Score] = field(default_factory=list)


def best_of(scores: list[Score], production: Score) -> Score:
    """The version with the highest validation success on the tasks it shares with
    production; the newest of equals (it carries the most training)."""
    return max(scores, key=lambda s: (rate_on(s, common_tasks(s, production)), s.version or 0))


def propose(since: list[Score], production: Score, *, margin: float, alpha: float,
            previous: Score | None = None) -> tuple[Proposal | None, str | None]:
    """The best of the versions scored since the last proposal, if it beats production
    on the same validation tasks by `margin` with p ≤ `alpha` — and beats `previous`, the
    last version proposed when it is not production (pending, or rejected: a version no
    better than one the gate is judging or turned down is not worth its holdout samples);
    else why not."""
    if not since:
        return None, "no version scored since the last proposal"
    best = best_of(since, production)
    assert best.version is not None
    if previous is not None and previous.version != production.version:
        shared = common_tasks(best, previous)
        if rate_on(best, shared) <= rate_on(previous, shared):
            return None, (f"v{best.version}, the best since v{previous.version} was proposed, "
                          f"is no better than it on validation ({rate_on(best, shared):.3f} "
                          f"vs {rate_on(previous, shared):.3f})")
    pr = paired_gain(best, production)
    considered = sorted(s.version for s in since if s.version is not None)
    vs = "the base model" if production.version is None else f"v{production.version}"
    said = (f"v{best.version} (best of v{considered[0]}–v{considered[-1]} on validation) "
            f"{pr.candidate:.3f} vs {vs} {pr.production:.3f} on {pr.tasks} validation tasks: "
            f"gain {pr.gain:+.3f}, {pr.wins} attempts gained, {pr.losses} lost, McNemar "
            f"p {pr.p_value:.3f}")
    if pr.tasks == 0:
        return None, f"v{best.version} and {vs} share no scored validation task"
    if pr.gain < margin:
        return None, f"{said} < margin {margin:g}"
    if pr.p_value > alpha:
        return None, f"{said}: p > alpha {alpha:g}"
    return Proposal(best.version, pr, considered,
                    f"{said} (margin {margin:g}, alpha {alpha:g})"), None


def overfitting(curve: list[Score], *, window: int, rise: float) -> str | None:
    """The alarm, in words, when over the last `window` GRPO versions (oldest first) the
    training reward rose by at least `rise` while no version after the first beat the best
    validation success reached up to it; None otherwise. When that best is every validation
    attempt solved, no version can beat it: flat validation there says nothing, and only a
    fall below it (the newest version) raises the alarm."""
    grpo = [s for s in curve if s.train_reward is not None]
    if len(grpo) < window:
        return None
    w = grpo[-window:]
    first, last = w[0].train_reward, w[-1].train_reward
    assert first is not None and last is not None
    best_before = max(s.rate for s in grpo[:len(grpo) - window + 1])
    after = max(s.rate for s in w[1:])
    at_ceiling = best_before >= 1.0 and w[-1].rate >= best_before
    if last - first >= rise and after <= best_before and not at_ceiling:
        return (f"training reward rose {first:.3f} → {last:.3f} over v{w[0].version}–"
                f"v{w[-1].version} while validation success stayed at or below "
                f"{best_before:.3f} (now {w[-1].rate:.3f}): the policy is learning its "
                "training tasks, not the skill")
    return None


def judge(curve: list[Score], production: Score, *, last_proposed: int | None,
          margin: float, alpha: float, window: int, rise: float,
          alarm_after: int | None = None) -> Outcome:
    """After a version was scored: what to propose (if anything) and whether to alarm.
    `curve`: every GRPO version scored, oldest first; `last_proposed`: the newest version
    already proposed to the gate (those up to it are not considered again, and the next
    proposal must beat it on validation unless it is production); `alarm_after`: the
    overfitting alarm looks only at versions after it (the newest version when a pause
    ended: the versions that caused it do not raise it again)."""
    since = [s for s in curve if s.version is not None
             and (last_proposed is None or s.version > last_proposed)]
    previous = next((s for s in curve if s.version == last_proposed), None)
    proposal, why_not = propose(since, production, margin=margin, alpha=alpha,
                                previous=previous)
    watched = [s for s in curve if alarm_after is None or (s.version or 0) > alarm_after]
    alarm = overfitting(watched, window=window, rise=rise)
    best = best_of(curve, production).version if curve else None
    return Outcome(proposal, why_not, alarm, best, watched[-window:])
