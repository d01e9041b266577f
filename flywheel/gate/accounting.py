"""What an evaluation counts: every attempt the model made, paired, in complete rounds.

An `Attempt` is one scored sample of one holdout task. Whatever the model did is scored
(`flywheel.rollout.loop`): an empty reply, a truncated one, a timeout and an unreadable reply
are failures with reward 0 and their own failure mode, so a candidate that abstains where it
would lose is measured on every task, not on the ones it chose to answer. Only an attempt the
infrastructure failed to run (engine unreachable, judge or sandbox unavailable, our crash) is
missing from `attempts`; it is counted in `not_run` by kind, and the gate retries it.

The unit of the paired test is the (task, sample index) pair, and a round is usable only when
it is *complete*: both sides have an attempt for every task at every index of the round. The
usable rounds are the complete ones from round 0 up to the first gap; an evaluation whose test
needed a round beyond a gap ends `incomplete` — recorded, never a promotion (`decision`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from flywheel.events import GateMetrics
from flywheel.tasks import ATTEMPT_FAILURES  # the decision record counts each, both sides


@dataclass(frozen=True)
class Attempt:
    task: str
    index: int
    success: bool
    reward: float
    invalid: bool
    unsafe: bool
    latency_ms: float
    tokens: int
    failure_mode: str | None = None
    """Why it failed (`ATTEMPT_FAILURES`); None when it succeeded."""
    # What the model did, for the reward-hacking checks and "what changed"
    # (`flywheel.gate.behaviour`, `flywheel.gate.changes`); runs cached before these were
    # kept read back with `turns` 0 and are left out of those checks.
    reply: str = ""
    """The reply's text (every turn's, joined), cut to `REPLY_CHARS`."""
    reply_chars: int = 0
    finish_reason: str = ""
    """The last turn's (`length` = cut by max_tokens)."""
    turns: int = 0
    calls: list[str] = field(default_factory=list)
    """Names of the tools the replies called, in order."""
    calling_turns: int = 0
    """Turns that called at least one tool."""
    components: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    """The verifier's reason in words, where it gives one (episode tasks)."""
    episode: list[dict[str, Any]] | None = None
    """Episode tasks: the attempt turn by turn (`flywheel.events.EpisodeTurn` as JSON: its
    calls with arguments and tool results, its answer, the scripted user's next message),
    for "what changed"; None for a single step."""


REPLY_CHARS = 600


@dataclass(frozen=True)
class EvalRun:
    """One side: every scored attempt, and the groups each task belongs to."""

    version: int | None
    task_groups: dict[str, list[str]]
    attempts: list[Attempt]
    not_run: int = 0
    """Attempts the infrastructure failed to run after the retries (never scored)."""
    not_run_kinds: dict[str, int] = field(default_factory=dict)
    """`not_run` by kind (`crash`, `sandbox`, `judge_unavailable`, `verifier_timeout`)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EvalRun:
        return cls(version=data["version"], task_groups=data["task_groups"],
                   attempts=[Attempt(**a) for a in data["attempts"]],
                   not_run=data["not_run"], not_run_kinds=data.get("not_run_kinds", {}))

    @classmethod
    def combine(cls, rounds: Sequence[EvalRun]) -> EvalRun:
        """Rounds of one side as one run (their attempts have distinct sample indices)."""
        if not rounds:
            raise ValueError("no rounds to combine")
        kinds: dict[str, int] = {}
        for r in rounds:
            for kind, n in r.not_run_kinds.items():
                kinds[kind] = kinds.get(kind, 0) + n
        return cls(version=rounds[0].version, task_groups=rounds[0].task_groups,
                   attempts=[a for r in rounds for a in r.attempts],
                   not_run=sum(r.not_run for r in rounds), not_run_kinds=kinds)


def _keys(run: EvalRun) -> set[tuple[str, int]]:
    return {(x.task, x.index) for x in run.attempts}


def rounds_seen(cand: EvalRun, base: EvalRun, round_samples: int) -> int:
    """Rounds both sides have reached (each side's highest index, in rounds): a side with
    more rounds cached than the other is not a gap, a round reached with pairs missing is."""
    def reached(run: EvalRun) -> int:
        return max(x.index for x in run.attempts) // round_samples + 1 if run.attempts else 0
    return min(reached(cand), reached(base))


def complete_rounds(cand: EvalRun, base: EvalRun, round_samples: int) -> int:
    """How many rounds from round 0 are complete on both sides (see the module doc)."""
    tasks = set(cand.task_groups) | set(base.task_groups)
    if not tasks:
        return 0
    c, b = _keys(cand), _keys(base)
    done = 0
    while True:
        want = {(t, done * round_samples + i) for t in tasks for i in range(round_samples)}
        if not (want <= c and want <= b):
            return done
        done += 1


def missing_pairs(cand: EvalRun, base: EvalRun, round_: int, round_samples: int
                  ) -> tuple[int, int]:
    """(candidate, production) attempts missing from round `round_`."""
    tasks = set(cand.task_groups) | set(base.task_groups)
    want = {(t, round_ * round_samples + i) for t in tasks for i in range(round_samples)}
    return len(want - _keys(cand)), len(want - _keys(base))


def failure_counts(run: EvalRun) -> dict[str, int]:
    """Attempts per failure mode, every mode listed (zeros too), unknown ones after."""
    counts = dict.fromkeys(ATTEMPT_FAILURES, 0)
    for x in run.attempts:
        if x.failure_mode is not None:
            counts[x.failure_mode] = counts.get(x.failure_mode, 0) + 1
    return counts


def failure_line(mc: GateMetrics, mb: GateMetrics) -> str:
    """Both sides' failure modes in words, the modes either side has (candidate vs
    production), the biggest shift first — e.g. "empty 16 vs 0, bad_arguments 0 vs 12"."""
    modes = [m for m in mc.failure_modes if mc.failure_modes[m] or mb.failure_modes.get(m)]
    modes.sort(key=lambda m: -abs(mc.failure_modes[m] - mb.failure_modes.get(m, 0)))
    shown = ", ".join(f"{m} {mc.failure_modes[m]} vs {mb.failure_modes.get(m, 0)}"
                      for m in modes)
    return (f"failure modes of {mc.samples} candidate and {mb.samples} production attempts "
            f"(candidate vs production): {shown or 'none'}")
