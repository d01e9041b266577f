"""Failure classifier: deterministic rules with recorded evidence (pure, no I/O).

The rules look for the first failing decision in a trajectory, in this order of precedence
per function call: hallucinated tool → unsafe action → invalid format (arguments not a JSON
object) → bad arguments (violating the tool's JSON schema) → disagreement with a known
expected action (wrong tool / bad arguments, judged as the tool_call verifier judges: each
call against a not yet used expected call of its name, order-free) → the call's output
(tool error / timeout).
Outcome-level statuses (timeout, escalated) and the shape of the ending (incomplete,
unparseable tool-call text) decide the rest. An optional `Labeller` (an LLM judge, say) may
refine the rules' `other`; it is off by default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from flywheel.environments.matching import arguments_match
from flywheel.tasks import ExpectedCall, FailureMode
from flywheel.trajectory import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    Tool,
    Trajectory,
)


@dataclass(frozen=True)
class Classification:
    mode: FailureMode
    evidence: dict[str, Any]
    step: int | None
    """Index into `items` of the failing decision (None when no single step is to blame)."""


class Labeller(Protocol):
    """Optional second opinion for failures the rules cannot explain (`other`)."""

    def label(self, trajectory: Trajectory, rules: Classification) -> Classification | None: ...


@dataclass
class _Tools:
    by_name: dict[str, Tool] = field(default_factory=dict)

    @classmethod
    def of(cls, trajectory: Trajectory) -> _Tools:
        return cls({t.name: t for t in trajectory.tools})

    def unsafe(self, name: str) -> bool:
        tool = self.by_name.get(name)
        return bool(tool is not None and (tool.model_extra or {}).get("x-unsafe"))


def decision_start(t: Trajectory) -> int:
    """Index of the first item under judgement: the answer of a request/response pair (what
    precedes it is the request's context, judged with the earlier calls that made it), else
    0 (the whole trajectory)."""
    start = t.metadata.get("response_index")
    if t.metadata.get("source_format") == "request_response" and isinstance(start, int):
        return max(0, min(start, len(t.items)))
    return 0


def parse_arguments(raw: str) -> dict[str, Any] | None:
    try:
        value = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def schema_errors(tool: Tool, args: dict[str, Any]) -> list[str]:
    try:
        validator = Draft202012Validator(tool.parameters)
        return sorted(f"{'.'.join(str(p) for p in e.absolute_path) or '(arguments)'}: "
                      f"{e.message}" for e in validator.iter_errors(args))
    except SchemaError as err:
        return [f"tool schema is invalid: {err.message}"]
    except Exception as err:  # e.g. a bad regex in `pattern`: the schema, not the call
        return [f"tool schema cannot be checked: {err}"]


def _looks_like_tool_call(text: str) -> bool:
    s = text.strip()
    return s.startswith("{") and ('"tool"' in s or '"name"' in s or '"arguments"' in s)


def _final_text(t: Trajectory) -> str | None:
    for item in reversed(t.items):
        if isinstance(item, MessageItem) and item.role == "assistant":
            return item.content if isinstance(item.content, str) else None
    return None


def _disagreement(unused: list[ExpectedCall], name: str, args: dict[str, Any],
                  schema: dict[str, Any]) -> tuple[FailureMode, dict[str, Any]] | None:
    """How a call disagrees with the expected calls not yet made (None: it is one of them,
    which is then used up)."""
    same = [c for c in unused if c.name == name]
    if not same:
        return "wrong_tool", {"expected_tool": unused[0].name}
    scored = [(arguments_match(c.arguments, args, schema, alternatives=c.alternatives,
                               optional=c.optional)[0], n) for n, c in enumerate(same)]
    share, best = max(scored, key=lambda sn: (sn[0], -sn[1]))
    if share < 1.0:
        return "bad_arguments", {"arguments": args, "expected_arguments": same[best].arguments}
    unused.remove(same[best])
    return None


def classify_failure(t: Trajectory, expected: list[ExpectedCall] | None = None,
                     labeller: Labeller | None = None) -> Classification:
    """Why did this (failed) trajectory fail? `expected`: the known right calls, if any.

    Calls before `decision_start` (a pair's request context) are not judged; they only use
    up their expected counterparts."""
    if t.outcome is None:
        raise ValueError(f"trajectory {t.trajectory_id} has no outcome yet: nothing to classify")
    if t.outcome.status == "timeout":
        return Classification("timeout", {"outcome": "timeout", "error": t.outcome.error}, None)
    if t.outcome.status == "escalated":
        return Classification("escalated", {"outcome": "escalated",
                                            "feedback": t.outcome.feedback}, None)
    start = decision_start(t)
    tools = _Tools.of(t)
    outputs = {i.call_id: i for i in t.items if isinstance(i, FunctionCallOutputItem)}
    calls = [(n, i) for n, i in enumerate(t.items) if isinstance(i, FunctionCallItem)]
    unused = list(expected) if expected is not None else None
    for step, call in calls:
        if step < start:
            same = next((c for c in unused or () if c.name == call.name), None)
            if unused and same is not None:
                unused.remove(same)
            continue
        ev: dict[str, Any] = {"call_id": call.call_id, "tool": call.name}
        if call.name not in tools.by_name:
            return Classification("hallucinated_tool", {**ev, "offered": sorted(tools.by_name)},
                                   step)
        if tools.unsafe(call.name):
            return Classification("unsafe_action", {**ev, "reason": "tool marked x-unsafe"}, step)
        args = parse_arguments(call.arguments)
        if args is None:
            return Classification("invalid_format", {**ev, "arguments": call.arguments[:500],
                                                     "reason": "arguments are not a JSON object"},
                                  step)
        errors = schema_errors(tools.by_name[call.name], args)
        if errors:
            return Classification("bad_arguments", {**ev, "schema_errors": errors[:10]}, step)
        if unused:
            wrong = _disagreement(unused, call.name, args, tools.by_name[call.name].parameters)
            if wrong is not None:
                mode, detail = wrong
                return Classification(mode, {**ev, **detail}, step)
        out = outputs.get(call.call_id)
        if out is not None and out.status == "timeout":
            return Classification("timeout", {**ev, "output": out.output[:500]}, step)
        if out is not None and out.status == "error":
            return Classification("tool_error", {**ev, "output": out.output[:500]}, step)
    if unused:
        return Classification("incomplete", {"reason": "expected calls never made",
                                             "missing": [c.name for c in unused]}, None)
    final = _final_text(t)
    if final is not None and _looks_like_tool_call(final):
        try:
            json.loads(final)
        except json.JSONDecodeError:
            return Classification("invalid_format", {"reason": "tool call text is not valid "
                                                     "JSON", "text": final[:500]},
                                  len(t.items) - 1)
    last = t.items[-1] if t.items else None
    if last is None or isinstance(last, FunctionCallItem) or (
            isinstance(last, FunctionCallOutputItem)) or (not calls and tools.by_name):
        return Classification("incomplete", {"reason": "ended without a final answer"
                                             if calls else "no tool was called",
                                             "items": len(t.items)}, None)
    rules = Classification("other", {"outcome": t.outcome.status, "error": t.outcome.error},
                           None)
    if labeller is not None:
        return labeller.label(t, rules) or rules
    return rules
