"""Where a failure's expected action comes from, turn by turn (pure).

In order of trust: a human correction (`outcome.human_intervention.corrected_items`),
structured feedback (`outcome.feedback`, a JSON string or an object: `{"expected_call":
{…}}` or `{"expected_calls": [{…}, …]}`, each call an `ExpectedCall`, so with
`alternatives` and `optional` if need be), or a later successful retry of the same request
in the same session. A failure with no such evidence has no expected action — never guessed.
A later record that continues the failed one (the next request/response pair of the same
conversation, holding the failed answer in its history) is not a retry (`same_episode`).

A *turn* is the consecutive calls before the next tool result or message: the calls one
assistant message makes (parallel calls). A retry, or a correction that lists tool results
between its calls, shows its turns; feedback and a correction listing calls only are a
plain sequence of calls (`Expected.explicit` is False) that `build_task` lines up with the
failed trajectory's own turns.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from flywheel.mining.classify import parse_arguments
from flywheel.tasks import ExpectedCall
from flywheel.trajectory import FunctionCallItem, MessageItem, Trajectory


@dataclass(frozen=True)
class Expected:
    turns: tuple[tuple[ExpectedCall, ...], ...]
    source: str
    """human_correction | feedback | retry:<trajectory id>"""
    explicit: bool
    """Whether the turn boundaries are known (tool results or messages between the calls)."""

    @property
    def calls(self) -> list[ExpectedCall]:
        return [c for turn in self.turns for c in turn]


def call_turns(items: Sequence[Any]) -> list[list[int]]:
    """Indices of the function calls in `items`, grouped into turns."""
    turns: list[list[int]] = []
    previous_was_call = False
    for n, item in enumerate(items):
        is_call = isinstance(item, FunctionCallItem)
        if is_call and previous_was_call:
            turns[-1].append(n)
        elif is_call:
            turns.append([n])
        previous_was_call = is_call
    return turns


def call_groups(items: Sequence[Any]) -> list[list[FunctionCallItem]]:
    """The function calls of `items`, grouped into turns."""
    return [[items[n] for n in turn] for turn in call_turns(items)]


def turns_of(items: Sequence[Any]) -> tuple[tuple[ExpectedCall, ...], ...] | None:
    """The calls of `items` as turns, or None when a call's arguments are not a JSON object."""
    out = []
    for turn in call_groups(items):
        calls = []
        for item in turn:
            args = parse_arguments(item.arguments)
            if args is None:
                return None
            calls.append(ExpectedCall(name=item.name, arguments=args))
        out.append(tuple(calls))
    return tuple(out)


def feedback_calls(feedback: object) -> list[ExpectedCall] | None:
    """The calls structured feedback names; None when it names none (or malformed ones)."""
    fb = feedback
    if isinstance(fb, str):
        try:
            fb = json.loads(fb)
        except json.JSONDecodeError:
            return None
    if not isinstance(fb, dict):
        return None
    raw = fb.get("expected_calls", [fb["expected_call"]] if "expected_call" in fb else None)
    if not isinstance(raw, list) or not raw:
        return None
    try:
        return [ExpectedCall.model_validate(_decoded(c)) for c in raw]
    except ValidationError:
        return None  # malformed feedback is no evidence of the expected action


def _decoded(call: object) -> object:
    """A call whose `arguments` is a JSON string (as OpenAI sends them), decoded."""
    if isinstance(call, dict) and isinstance(call.get("arguments"), str):
        args = parse_arguments(call["arguments"])
        return {**call, "arguments": args} if args is not None else call
    return call


def expected_actions(t: Trajectory, retry: Trajectory | None = None) -> Expected | None:
    """The expected calls of failed trajectory `t` and where they came from, or None."""
    if t.outcome is None:
        return None
    hi = t.outcome.human_intervention
    if hi is not None and any(isinstance(i, FunctionCallItem) for i in hi.corrected_items):
        turns = turns_of(hi.corrected_items)
        if turns:
            return Expected(turns, "human_correction", explicit=len(turns) > 1)
    if t.outcome.feedback:
        calls = feedback_calls(t.outcome.feedback)
        if calls:
            return Expected((tuple(calls),), "feedback", explicit=False)
    if retry is not None and retry.is_success and not same_episode(t, retry):
        turns = turns_of(retry.items)
        if turns:
            return Expected(turns, f"retry:{retry.trajectory_id}", explicit=True)
    return None


def expected_calls(t: Trajectory, retry: Trajectory | None = None
                   ) -> tuple[list[ExpectedCall], str] | None:
    """(expected calls, where they came from), or None when the trajectory does not show them."""
    found = expected_actions(t, retry)
    return None if found is None else (found.calls, found.source)


def _shape(item: Any) -> tuple[Any, ...]:
    """An item as episodes compare it: call ids differ between logs of one conversation."""
    if isinstance(item, FunctionCallItem):
        return ("call", item.name, item.arguments)
    if isinstance(item, MessageItem):
        return ("message", item.role, item.content if isinstance(item.content, str)
                else repr(item.content))
    return (item.type, getattr(item, "output", None), getattr(item, "content", None))


def _acts(items: list[Any]) -> bool:
    return any(isinstance(i, FunctionCallItem) or (isinstance(i, MessageItem)
                                                   and i.role == "assistant") for i in items)


def same_episode(a: Trajectory, b: Trajectory) -> bool:
    """Whether one of the two continues the other (its items start with all of the other's,
    and those include an action): two calls of one conversation, not a retry of it."""
    short, long_ = sorted((a.items, b.items), key=len)
    if not _acts(short):
        return False
    return [_shape(i) for i in short] == [_shape(i) for i in long_[:len(short)]]
