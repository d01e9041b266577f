"""`toolset`: multi-step episodes on a registered toolset — the agent's own tools.

Each episode opens a session of the task's toolset (`ToolsetSpec.toolset`, found in the
process's catalog, `flywheel.tools.runtime`) on the task's initial state; the model's calls
go through the session (safety, replay of the logged results, the live backend:
`flywheel.tools.session`), and each answer's source is kept on the turn. What the session
could not do because the infrastructure failed (a server down or killed, a session that
would not start, `mask` at a divergence) leaves the attempt not run; the model's own
mistakes come back to it as tool error messages. The step budget is the spec's
`max_steps`: a call past it is answered with an error and counted against the attempt.

`session_output` is what the verifier scores: the calls made (with their sources), the end
state (the toolset's `state()` snapshot, taken only when the spec checks one) and how the
episode ended. `verify_toolset` is pure.

Episode tasks (`EpisodeSpec`, mined from production failures: docs/EPISODES.md) run here
too: their session starts with the calls of the conversation's earlier turns (`setup`),
`anext_user` gives the scripted user's messages one per final answer, and the output adds
the answers and the reference end state — the state the reference path reaches on a fresh
session of the toolset (`ToolsetRuntime.end_state`), computed once per task and toolset
version before the group's sessions open. `flywheel.environments.episode` scores it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.environments.base import (
    AnySpec,
    Environment,
    StepResult,
    ToolSchemas,
    abstained,
    expect_spec,
    result,
    tool_names,
    unsafe_names,
)
from flywheel.environments.calls import Call
from flywheel.environments.episode import executed, verify_episode
from flywheel.environments.matching import arguments_match
from flywheel.environments.scoring import best_assignment, call_share
from flywheel.events import ToolStep
from flywheel.tasks import EpisodeSpec, FailureMode, RolloutNotRun, ToolsetSpec, VerifierResult
from flywheel.tools.descriptors import Registration
from flywheel.tools.replay import Matcher
from flywheel.tools.runtime import Catalog, ToolsetRuntime, default_catalog
from flywheel.tools.session import EpisodePlan, ToolSession

_COMPONENTS = ("state", "calls", "unsafe")


def schema_matcher(registration: Registration) -> Matcher:
    """Replay's "same call": arguments equal under the verifier's matching, typed by the
    tool's schema."""
    def match(name: str, logged: dict[str, Any], made: dict[str, Any]) -> bool:
        tool = registration.tool(name)
        return arguments_match(logged, made, tool.parameters if tool else None)[0] == 1.0

    return match


def _canonical(value: Any) -> str:
    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v

    return json.dumps(norm(value), sort_keys=True)


def _calls_made(spec: ToolsetSpec, calls: Sequence[Mapping[str, Any]],
                tools: ToolSchemas | None) -> float:
    """Share of `spec.expected_calls` made (a multiset: each call made counts once)."""
    made = [Call(str(c.get("name")), dict(c.get("arguments") or {}))
            for c in calls if executed(c)]
    weights = [[1.0 if (s := call_share(want, call, tools)) is not None and s[0] == 1.0
                else None for call in made] for want in spec.expected_calls]
    return len(best_assignment(weights)) / len(spec.expected_calls) if made else 0.0


def verify_toolset(spec: ToolsetSpec, output: Mapping[str, Any],
                   tools: ToolSchemas | None = None) -> VerifierResult:
    """Score an episode's calls and end state against `spec` (see `ToolsetSpec`)."""
    calls: list[Mapping[str, Any]] = list(output.get("calls") or [])
    unsafe = unsafe_names(spec.unsafe_tools, tools)
    used = sorted({str(c["name"]) for c in calls if c.get("unsafe") or c["name"] in unsafe})
    comps = dict.fromkeys(_COMPONENTS, 0.0)
    comps["unsafe"] = float(bool(used))
    details: dict[str, Any] = {"steps": len(calls), "ended_by": output.get("ended_by"),
                               "sources": [c.get("source") for c in calls[:20]]}
    checks: list[float] = []
    if spec.expected_state is not None:
        state = output.get("state")
        if state is None:
            raise ValueError(f"toolset {spec.toolset!r}: the spec checks an end state but the "
                             f"episode has none (does the toolset keep a state() snapshot?)")
        comps["state"] = float(_canonical(state) == _canonical(spec.expected_state))
        checks.append(comps["state"])
    if spec.expected_calls:
        comps["calls"] = _calls_made(spec, calls, tools)
        checks.append(comps["calls"])
    if used:
        return result(0.0, comps, "unsafe_action", unsafe_tools=used, **details)
    if len(calls) > spec.max_steps:
        return result(0.0, comps, "incomplete", max_steps=spec.max_steps, **details)
    if all(c == 1.0 for c in checks):
        return result(1.0, comps, None, **details)
    errors = [c for c in calls if c.get("status") != "ok"]
    offered = tool_names(tools) if tools is not None else None
    mode: FailureMode = (
        "hallucinated_tool" if offered is not None and any(c["name"] not in offered
                                                           for c in calls)
        else "tool_error" if errors
        else "incomplete" if not calls or output.get("ended_by") == "end" else "other")
    if errors:
        details["errors"] = [{"tool": c["name"], "output": str(c.get("output", ""))[:200]}
                             for c in errors[:5]]
    return result(0.5 * sum(checks) / len(checks), comps, mode, **details)


@dataclass
class _Open:
    runtime: ToolsetRuntime
    session: ToolSession
    spec: ToolsetSpec | EpisodeSpec
    reference: dict[str, Any] | None = None
    answers: list[str] = field(default_factory=list)
    turn_references: list[dict[str, Any]] = field(default_factory=list)
    """The reference path's state at each scripted user turn (`EpisodeSpec.reference_turns`)."""
    turn_states: list[dict[str, Any] | None] = field(default_factory=list)
    """The episode's state when the agent answered each earlier user turn."""


def _spec(spec: AnySpec) -> ToolsetSpec | EpisodeSpec:
    if isinstance(spec, ToolsetSpec | EpisodeSpec):
        return spec
    return expect_spec(spec, ToolsetSpec, "toolset")  # raises, naming the mismatch


def _reference_key(runtime: ToolsetRuntime, spec: EpisodeSpec, upto: int | None = None) -> str:
    calls = spec.reference_calls[:upto] if upto is not None else spec.reference_calls
    body = {"initial": spec.initial_state,
            "calls": [{"name": c.name, "arguments": c.arguments} for c in calls]}
    return f"{runtime.name}@{runtime.registration.version}:{_canonical(body)}"


class ToolsetEnvironment(Environment):
    """Sessions on registered toolsets; `verify` scores what `session_output` gives."""

    name = "toolset"
    multi_step = True

    def __init__(self, catalog: Catalog | None = None) -> None:
        self._catalog = catalog
        self._open: dict[str, _Open] = {}
        self._references: dict[str, dict[str, Any] | RolloutNotRun | None] = {}

    @property
    def catalog(self) -> Catalog:
        return self._catalog if self._catalog is not None else default_catalog()

    def verify(self, spec: AnySpec, output: object, *,
               tools: ToolSchemas | None = None) -> VerifierResult:
        ts = _spec(spec)
        if output is None:
            return abstained(dict.fromkeys(_COMPONENTS, 0.0), "the episode made no call")
        if not isinstance(output, Mapping):
            raise TypeError(f"toolset scores the dict session_output gives, got "
                            f"{type(output).__name__}")
        if isinstance(ts, EpisodeSpec):
            return verify_episode(ts, output, tools)
        return verify_toolset(ts, output, tools)

    async def _reference(self, runtime: ToolsetRuntime, spec: EpisodeSpec,
                         upto: int | None = None) -> dict[str, Any] | RolloutNotRun | None:
        """The reference end state of an episode task (cached per toolset version); with
        `upto`, the state after that many reference calls. A path that does not run is the
        task's fault, not the model's: its attempts are not run."""
        if not spec.check_state:
            return None
        key = _reference_key(runtime, spec, upto)
        if key not in self._references:
            path = spec.reference_calls[:upto] if upto is not None else spec.reference_calls
            calls = [{"name": c.name, "arguments": c.arguments} for c in path]
            try:
                found: dict[str, Any] | RolloutNotRun | None = await runtime.end_state(
                    spec.initial_state, calls)
            except RolloutNotRun as err:
                return err  # the toolset is down now: try again next time
            except ValueError as err:
                found = RolloutNotRun("crash", f"the episode's reference path does not run on "
                                      f"{runtime.name} v{runtime.registration.version}: {err}")
            if found is None:
                found = RolloutNotRun("crash", f"toolset {runtime.name!r} keeps no state "
                                      f"snapshot, but the episode checks its end state")
            self._references[key] = found
        return self._references[key]

    async def aopen(self, session_ids: Sequence[str], spec: AnySpec
                    ) -> list[RolloutNotRun | None]:
        ts = _spec(spec)
        try:
            runtime = await self.catalog.runtime(ts.toolset)
        except RolloutNotRun as err:
            return [err for _ in session_ids]
        reference: dict[str, Any] | None = None
        turns: list[dict[str, Any]] = []
        if isinstance(ts, EpisodeSpec):
            # Before the group's sessions take their slots: the reference needs one too.
            found = await self._reference(runtime, ts)
            if isinstance(found, RolloutNotRun):
                return [found for _ in session_ids]
            reference = found
            for upto in ts.reference_turns:
                at = await self._reference(runtime, ts, upto)
                if isinstance(at, RolloutNotRun):
                    return [at for _ in session_ids]
                if at is not None:
                    turns.append(at)
        match = schema_matcher(runtime.registration)
        setup = ts.setup if isinstance(ts, EpisodeSpec) else []
        # A key of its own per attempt: a retried group reuses its session ids.
        plans = [EpisodePlan(key=f"{sid}#{uuid.uuid4().hex[:12]}",
                             initial_state=ts.initial_state, replay=ts.replay,
                             rule=ts.on_divergence, match=match, setup=list(setup))
                 for sid in session_ids]
        opened = await runtime.open_sessions(plans)
        out: list[RolloutNotRun | None] = []
        for sid, session in zip(session_ids, opened, strict=True):
            if isinstance(session, RolloutNotRun):
                out.append(session)
                continue
            if sid in self._open:
                await runtime.close_session(session)
                raise ValueError(f"toolset: session {sid!r} is already open")
            self._open[sid] = _Open(runtime, session, ts, reference, turn_references=turns)
            out.append(None)
        return out

    async def astep(self, session_id: str, name: str,
                    arguments: Mapping[str, Any] | str) -> StepResult:
        ep = self._get(session_id)
        if len(ep.session.calls) >= ep.spec.max_steps:
            ep.session.calls.append({"name": name, "arguments": arguments, "source": "invalid",
                                     "status": "error", "unsafe": False, "rule": None,
                                     "output": "step budget exhausted"})
            return StepResult(f"error: step budget exhausted ({ep.spec.max_steps} calls); "
                              f"stop calling tools and answer",
                              record=ToolStep(name=name, source="invalid", status="error"))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as exc:
                return StepResult(f"error: arguments are not valid JSON: {exc}",
                                  record=ToolStep(name=name, source="invalid", status="error"))
        if not isinstance(arguments, Mapping):
            return StepResult("error: arguments must be a JSON object",
                              record=ToolStep(name=name, source="invalid", status="error"))
        outcome = await ep.session.call(name, dict(arguments))
        return StepResult(outcome.observation, outcome.end, outcome.step)

    async def anext_user(self, session_id: str, answer: str) -> str | None:
        ep = self._get(session_id)
        ep.answers.append(answer)
        if not isinstance(ep.spec, EpisodeSpec) or not answer.strip():
            return None  # an empty answer ends the episode: nothing to reply to
        given = len(ep.answers) - 1
        if given >= len(ep.spec.user_turns):
            return None
        if ep.turn_references:  # the state this turn left, before the next request
            ep.turn_states.append(await ep.session.snapshot())
        return ep.spec.user_turns[given]

    async def asession_output(self, session_id: str) -> dict[str, Any]:
        ep = self._get(session_id)
        checks = (ep.spec.check_state if isinstance(ep.spec, EpisodeSpec)
                  else ep.spec.expected_state is not None)
        state = await ep.session.snapshot() if checks else None
        return {"calls": ep.session.calls, "state": state, "ended_by": ep.session.ended_by,
                "toolset": ep.runtime.name, "version": ep.runtime.registration.version,
                "answers": list(ep.answers), "reference_state": ep.reference,
                "turn_states": list(ep.turn_states),
                "turn_reference_states": list(ep.turn_references)}

    async def aclose(self, session_id: str) -> None:
        ep = self._open.pop(session_id, None)
        if ep is not None:
            await ep.runtime.close_session(ep.session)

    def _get(self, session_id: str) -> _Open:
        try:
            return self._open[session_id]
        except KeyError:
            raise KeyError(f"toolset: no open session {session_id!r}; aopen it first") \
                from None

    def reset(self, session_id: str, spec: AnySpec) -> None:
        raise NotImplementedError("toolset sessions are async: the rollout loop opens them "
                                  "with aopen")

    def step(self, session_id: str, name: str, arguments: Mapping[str, Any] | str) -> str:
        raise NotImplementedError("toolset sessions are async: use astep")

    def session_output(self, session_id: str) -> object:
        raise NotImplementedError("toolset sessions are async: use asession_output")

    def close(self, session_id: str) -> None:
        raise NotImplementedError("toolset sessions are async: use aclose")
