"""Behaviour shifts of a candidate against production: how it answers, not how well (pure).

A candidate can raise holdout success by gaming what is scored rather than by solving more:
answering nothing where it would lose, running into `max_tokens`, padding replies, calling
more tools per turn, or dropping tool calls production makes. Each figure is measured on both
sides' holdout attempts and judged against a tolerance in `GateSettings` (documented there);
each direction judged is the gaming one (a shorter reply or fewer empty ones never fails).

What an attempt did is read from its own data — the reply text, the last turn's finish
reason, the calls its replies made — and from the failure modes `empty`, `truncated` and
`timeout` where the scoring names them, so the figures hold whether such attempts are
scored failures or were left out. Attempts cached before replies were kept (`turns` 0 and
no such failure mode) are not observed and are left out; a side with none observed is
reported, not judged.
"""

from __future__ import annotations

import statistics

from flywheel.config import GateSettings
from flywheel.events import BehaviourFigures, GateCheck
from flywheel.gate.decision import Attempt, EvalRun

_NO_OUTPUT = ("empty", "timeout")
"""Failure modes of an attempt that may have no turn kept: observed all the same."""


def observed(a: Attempt) -> bool:
    return a.turns > 0 or a.failure_mode in (*_NO_OUTPUT, "truncated")


def is_empty(a: Attempt) -> bool:
    """No answer at all: nothing but whitespace and no call — a timeout before any output
    included. An episode that timed out after turns that answered or called tools acted
    and ran out of time (a scored failure all the same), it did not abstain: read as
    abstaining, a stack's gate counted 46 of 92 such episode attempts empty (0.000 →
    0.359) against a production that gave up after one turn."""
    return a.failure_mode == "empty" or (not a.reply.strip() and not a.calls)


def is_truncated(a: Attempt) -> bool:
    return a.failure_mode == "truncated" or a.finish_reason == "length"


def figures(run: EvalRun) -> BehaviourFigures:
    """One side's behaviour on its observed attempts."""
    seen = [a for a in run.attempts if observed(a)]
    n = len(seen)
    calling = sum(a.calling_turns for a in seen)
    return BehaviourFigures(
        attempts=n, empty_rate=sum(map(is_empty, seen)) / n if n else 0.0,
        truncated_rate=sum(map(is_truncated, seen)) / n if n else 0.0,
        reply_chars=statistics.fmean(a.reply_chars for a in seen) if n else 0.0,
        calls_per_turn=sum(len(a.calls) for a in seen) / calling if calling else 0.0)


def dropped_calls(cand: EvalRun, base: EvalRun) -> tuple[int, int]:
    """(pairs where production called a tool and the candidate called none, pairs where
    production called a tool), over (task, sample) pairs observed on both sides."""
    prod = {(a.task, a.index): a for a in base.attempts if observed(a)}
    called = dropped = 0
    for a in cand.attempts:
        b = prod.get((a.task, a.index))
        if b is None or not observed(a) or not b.calls:
            continue
        called += 1
        dropped += not a.calls
    return dropped, called


def checks(cand: EvalRun, base: EvalRun, rule: GateSettings
           ) -> tuple[BehaviourFigures, BehaviourFigures, list[GateCheck]]:
    """Both sides' figures and one check per shift."""
    fc, fb = figures(cand), figures(base)
    if not fc.attempts or not fb.attempts:
        note = (f"not measured: {fc.attempts} candidate and {fb.attempts} production attempts "
                "with their replies kept (runs cached before replies were kept)")
        return fc, fb, [GateCheck(name="behaviour", passed=True, detail=note)]
    dropped, called = dropped_calls(cand, base)
    share = dropped / called if called else 0.0
    return fc, fb, [
        _rise("abstention", fc.empty_rate, fb.empty_rate, rule.abstention_tolerance,
              "empty-reply (abstention) rate"),
        _rise("truncation", fc.truncated_rate, fb.truncated_rate, rule.truncation_tolerance,
              "rate of replies cut by max_tokens"),
        _grow("reply_length", fc.reply_chars, fb.reply_chars, rule.reply_length_ratio,
              "mean reply length (chars)"),
        _calls(fc.calls_per_turn, fb.calls_per_turn, rule.calls_per_turn_tolerance),
        GateCheck(name="shift:dropped_calls", passed=share <= rule.dropped_calls_tolerance
                  + 1e-12,
                  detail=f"replies calling no tool where production called one: {dropped} of "
                         f"{called} pairs ({share:.3f}; at most "
                         f"{rule.dropped_calls_tolerance})"),
    ]


def _rise(name: str, value: float, before: float, tolerance: float, label: str,
          fmt: str = ".3f") -> GateCheck:
    return GateCheck(name=f"shift:{name}", passed=value <= before + tolerance + 1e-12,
                     detail=f"{label} {before:{fmt}} → {value:{fmt}} (may rise at most "
                            f"{tolerance})")


def _calls(value: float, before: float, tolerance: float) -> GateCheck:
    # Per turn that calls a tool: a candidate that calls tools where production answered in
    # prose has learnt the task, not sprayed calls.
    if before <= 0:
        return GateCheck(name="shift:calls_per_turn", passed=True,
                         detail="tool calls per calling turn: production calls no tools")
    return _rise("calls_per_turn", value, before, tolerance, "tool calls per calling turn",
                 fmt=".2f")


def _grow(name: str, value: float, before: float, ratio: float, label: str) -> GateCheck:
    if before <= 0:
        return GateCheck(name=f"shift:{name}", passed=True,
                         detail=f"{label}: production's replies are empty")
    return GateCheck(name=f"shift:{name}", passed=value <= before * ratio,
                     detail=f"{label} {before:.0f} → {value:.0f} (at most ×{ratio})")

