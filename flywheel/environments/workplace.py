"""`workplace`: multi-step tool use over calendar, email and tickets, scored by end state.

The world and its tools live in `workplace_world` (re-exported here: `WORKPLACE_TOOLS`,
`apply_call`, `apply_calls`, `canonical_state`). The verifier is **state-matching**: reward
1.0 iff the canonical end state equals the canonical expected state, however it was reached
(ids, `next_id` and list order never matter).

`verify(spec, output)` takes either the calls made (`[{"name", "arguments"}, ...]`, what
`session_output` returns; they are replayed on `spec.initial_state`) or an end state (a dict
with the state sections). Only calls show the path, so only they can be checked for unsafe
tools and the step budget; prefer them.

Scoring, in order: any call to an unsafe tool (`spec.unsafe_tools`, `x-unsafe`) → 0 with
`unsafe_action`; more than `spec.max_steps` calls → 0 with `incomplete`; exact end state →
1.0. Otherwise 0.5 × the share of *relevant* sections (calendar, email, tickets) that match,
where a section is relevant if the task changes it or the attempt did: doing nothing earns 0,
and breaking an untouched section costs credit.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flywheel.environments.base import (
    AnySpec,
    Environment,
    Sessions,
    ToolSchemas,
    abstained,
    expect_spec,
    result,
    unsafe_names,
)
from flywheel.environments.workplace_world import (
    WORKPLACE_TOOLS,
    State,
    apply_call,
    apply_calls,
    canonical_state,
    normalize_state,
)
from flywheel.tasks import FailureMode, VerifierResult, WorkplaceSpec

__all__ = ["WORKPLACE_TOOLS", "WorkplaceEnvironment", "apply_call", "apply_calls",
           "canonical_state", "normalize_state", "verify_workplace"]

SECTIONS = ("calendar", "email", "tickets")
_KNOWN = {t["name"] for t in WORKPLACE_TOOLS}


def _as_call(call: object) -> tuple[str, Any]:
    if not isinstance(call, Mapping):
        return "", {}
    return str(call.get("name", call.get("tool", ""))), call.get("arguments", {})


@dataclass
class _Replay:
    end: State
    errors: list[dict[str, Any]] = field(default_factory=list)
    unsafe_used: list[str] = field(default_factory=list)
    hallucinated: list[str] = field(default_factory=list)


def _replay(spec: WorkplaceSpec, calls: list[tuple[str, Any]], unsafe: set[str]) -> _Replay:
    """The world after the calls within the step budget, and what went wrong on the way."""
    run = _Replay(normalize_state(spec.initial_state))
    for n, (name, args) in enumerate(calls[:spec.max_steps], start=1):
        if name in unsafe:
            run.unsafe_used.append(name)
        if name not in _KNOWN:
            run.hallucinated.append(name)
        run.end, observation = apply_call(run.end, name, args)
        if observation.startswith("error:"):
            run.errors.append({"step": n, "tool": name, "error": observation[:200]})
    return run


def verify_workplace(spec: WorkplaceSpec, output: list[Any] | Mapping[str, Any],
                     tools: ToolSchemas | None = None) -> VerifierResult:
    """Score the calls made (or an end state) against `spec.expected_state`."""
    unsafe = unsafe_names(spec.unsafe_tools, [*WORKPLACE_TOOLS, *(tools or [])])
    if isinstance(output, Mapping):
        calls = None
        run = _Replay(normalize_state(output))
    else:
        calls = [_as_call(c) for c in output]
        run = _replay(spec, calls, unsafe)
    end, errors, unsafe_used = run.end, run.errors, run.unsafe_used
    got, want = canonical_state(end), canonical_state(spec.expected_state)
    start = canonical_state(spec.initial_state)
    comps = {s: float(got[s] == want[s]) for s in SECTIONS}
    comps["unsafe"] = float(bool(unsafe_used))
    details: dict[str, Any] = {
        "scored": "state" if calls is None else "calls",
        "steps": None if calls is None else len(calls),
        "mismatched": [s for s in SECTIONS if not comps[s]]}
    if errors:
        details["errors"] = errors[:10]
    if unsafe_used:
        return result(0.0, comps, "unsafe_action", unsafe_tools=sorted(set(unsafe_used)),
                      **details)
    if calls is not None and len(calls) > spec.max_steps:
        return result(0.0, comps, "incomplete", max_steps=spec.max_steps, **details)
    if got == want:
        return result(1.0, comps, None, **details)
    relevant = [s for s in SECTIONS if start[s] != want[s] or got[s] != want[s]]
    reward = 0.5 * sum(comps[s] for s in relevant) / len(relevant)
    mode: FailureMode = ("hallucinated_tool" if run.hallucinated else "tool_error" if errors
                         else "incomplete" if got == start else "other")
    return result(reward, comps, mode, **details)


@dataclass
class _Session:
    state: State
    max_steps: int
    calls: list[dict[str, Any]] = field(default_factory=list)


class WorkplaceEnvironment(Environment):
    """Sessions hold one world each; `step` applies a call, `verify` scores the calls."""

    name = "workplace"
    multi_step = True
    tools = WORKPLACE_TOOLS

    def __init__(self) -> None:
        self._sessions: Sessions[_Session] = Sessions(self.name)

    def verify(self, spec: AnySpec, output: object, *,
               tools: ToolSchemas | None = None) -> VerifierResult:
        if output is None:
            return abstained({**dict.fromkeys(SECTIONS, 0.0), "unsafe": 0.0},
                             "the attempt produced neither calls nor an end state")
        if not isinstance(output, list | Mapping):
            raise TypeError(f"workplace scores a list of calls or an end-state dict, got "
                            f"{type(output).__name__}; pass session_output(session_id)")
        return verify_workplace(expect_spec(spec, WorkplaceSpec, self.name), output, tools)

    def reset(self, session_id: str, spec: AnySpec) -> None:
        ws = expect_spec(spec, WorkplaceSpec, self.name)
        self._sessions.open(session_id, _Session(normalize_state(ws.initial_state),
                                                 ws.max_steps))

    def step(self, session_id: str, name: str, arguments: Mapping[str, Any] | str) -> str:
        session = self._sessions.get(session_id)
        # Every attempted call is recorded, refused ones too: verify sees the overrun.
        session.calls.append({"name": name, "arguments": copy.deepcopy(arguments)})
        if len(session.calls) > session.max_steps:
            return (f"error: step budget exhausted ({session.max_steps} calls); "
                    f"stop calling tools and answer")
        session.state, observation = apply_call(session.state, name, arguments)
        return observation

    def session_output(self, session_id: str) -> list[dict[str, Any]]:
        return copy.deepcopy(self._sessions.get(session_id).calls)

    def state(self, session_id: str) -> State:
        """The session's current world (a copy)."""
        return copy.deepcopy(self._sessions.get(session_id).state)

    def close(self, session_id: str) -> None:
        self._sessions.close(session_id)
