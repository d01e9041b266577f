"""The environment plugin contract: verify an attempt; optionally host multi-step sessions.

An environment scores one attempt at a task with `verify(spec, output, tools=...)` and
returns a `VerifierResult` (reward in [0, 1], named components, failure mode). What the
model did is always scored: an attempt that answered nothing is `empty` with reward 0
(`abstained`), an unreadable one `invalid_format` — abstaining must never beat a wrong
answer. Only a failure of the infrastructure (a judge or sandbox unavailable) raises
`RolloutNotRun`: the attempt is excluded from training and counted, never scored 0.

Multi-step environments also host sessions: `reset` opens one, `step` applies one tool call
and returns the observation, `session_output` gives what `verify` scores, `close` drops it.
Session state lives in `Sessions`, keyed by session id, so two rollouts never share state.
The rollout loop calls the async forms (`aopen`, `astep`, `asession_output`, `aclose`);
their defaults wrap the sync ones, and an environment whose sessions are I/O (a toolset's
servers) implements them instead. `anext_user` is told each final answer and may give the
next user message (an episode task's scripted user); the default ends the episode. `astep`
may end the episode (`StepResult.end`) and may record where the answer came from
(`StepResult.record`, kept on the turn); `aopen` and `astep` raise `RolloutNotRun` when the
infrastructure fails, never for the model's mistakes.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, TypeVar

from flywheel.events import ToolStep
from flywheel.tasks import (
    CodeSpec,
    EpisodeSpec,
    JudgeSpec,
    RolloutNotRun,
    TaskSpec,
    ToolCallSpec,
    ToolsetSpec,
    VerifierResult,
    WorkplaceSpec,
)

AnySpec = ToolCallSpec | WorkplaceSpec | ToolsetSpec | EpisodeSpec | CodeSpec | JudgeSpec
ToolSchemas = Sequence[Mapping[str, Any]]
"""OpenAI function-tool schemas, flat (`{"type": "function", "name": …, "parameters": …}`)."""

S = TypeVar("S", bound=AnySpec)
T = TypeVar("T")


@dataclass(frozen=True)
class StepResult:
    """What one tool call gave: the observation, whether the episode ends here, and where
    the answer came from (toolset episodes)."""

    observation: str
    end: bool = False
    record: ToolStep | None = None


class Environment(ABC):
    """One environment plugin. Instances may be shared by many concurrent rollouts."""

    name: ClassVar[str]
    multi_step: ClassVar[bool] = False
    reads: ClassVar[Literal["text", "message"]] = "text"
    """What a single-step `verify` is given: the reply's text, or the assistant message the
    policy's chat format parsed from it (`{"content", "tool_calls", "parse_error"?}`)."""

    @abstractmethod
    def verify(self, spec: AnySpec, output: object, *,
               tools: ToolSchemas | None = None) -> VerifierResult:
        """Score `output` against `spec`; raise `RolloutNotRun` only when the infrastructure
        could not score it (an empty output is scored: see `abstained`).

        `tools` are the task's tool schemas (types for argument matching, `x-unsafe` marks).
        """

    def verify_task(self, task: TaskSpec, output: object) -> VerifierResult:
        """Score an attempt at `task` (its verifier spec and its tools)."""
        return self.verify(task.verifier, output, tools=task.tools)

    def reset(self, session_id: str, spec: AnySpec) -> None:
        """Open session `session_id` on the task's initial state."""
        raise NotImplementedError(self._single_step_message())

    def step(self, session_id: str, name: str, arguments: Mapping[str, Any] | str) -> str:
        """Apply one tool call in the session; return the observation the model sees."""
        raise NotImplementedError(self._single_step_message())

    def session_output(self, session_id: str) -> object:
        """What `verify` scores for this session (e.g. the calls made)."""
        raise NotImplementedError(self._single_step_message())

    def close(self, session_id: str) -> None:
        """Drop the session's state (idempotent)."""
        raise NotImplementedError(self._single_step_message())

    async def aopen(self, session_ids: Sequence[str], spec: AnySpec
                    ) -> list[RolloutNotRun | None]:
        """Open the sessions of a group together; per session None, or why it could not
        be opened (it is then not run)."""
        out: list[RolloutNotRun | None] = []
        for session_id in session_ids:
            try:
                self.reset(session_id, spec)
                out.append(None)
            except RolloutNotRun as err:
                out.append(err)
        return out

    async def astep(self, session_id: str, name: str,
                    arguments: Mapping[str, Any] | str) -> StepResult:
        return StepResult(await asyncio.to_thread(self.step, session_id, name, arguments))

    async def asession_output(self, session_id: str) -> object:
        return self.session_output(session_id)

    async def anext_user(self, session_id: str, answer: str) -> str | None:
        """The agent answered (a reply without tool calls): the next scripted user message,
        or None when the episode is over (the default: one user turn per episode)."""
        return None

    async def aclose(self, session_id: str) -> None:
        self.close(session_id)

    def _single_step_message(self) -> str:
        return (f"environment {self.name!r} is single-step: score the model's output with "
                f"verify(spec, output) instead of opening a session")


def expect_spec(spec: AnySpec, cls: type[S], env: str) -> S:
    """`spec` as `cls`, or a TypeError naming the mismatch (a task routed to the wrong env)."""
    if not isinstance(spec, cls):
        raise TypeError(f"environment {env!r} verifies {cls.__name__}, got "
                        f"{type(spec).__name__}; check that TaskSpec.env matches verifier.kind")
    return spec


def result(reward: float, components: Mapping[str, float], failure_mode: Any,
           **details: Any) -> VerifierResult:
    """Build a VerifierResult with reward rounded to kill float noise (0.1+0.3+0.6 etc.)."""
    return VerifierResult(reward=round(reward, 6), reward_components=dict(components),
                          failure_mode=failure_mode, details=details)


def abstained(components: Mapping[str, float], why: str) -> VerifierResult:
    """The score of an attempt that answered nothing: reward 0, failure mode `empty`."""
    return result(0.0, dict.fromkeys(components, 0.0), "empty", error=why)


def _flat(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """A tool schema without the Chat Completions `{"function": {...}}` nesting."""
    inner = tool.get("function")
    if tool.get("type") == "function" and isinstance(inner, Mapping):
        return {**inner, "x-unsafe": tool.get("x-unsafe", inner.get("x-unsafe", False))}
    return tool


def tool_by_name(tools: ToolSchemas, name: str) -> Mapping[str, Any] | None:
    """The flat schema of tool `name`, or None when the task does not offer it."""
    for tool in tools:
        flat = _flat(tool)
        if flat.get("name") == name:
            return flat
    return None


def tool_names(tools: ToolSchemas) -> set[str]:
    return {n for n in (_flat(t).get("name") for t in tools) if isinstance(n, str)}


def unsafe_names(spec_unsafe: Sequence[str], tools: ToolSchemas | None) -> set[str]:
    """Tools whose call is an unsafe action: listed in the spec or marked `x-unsafe`."""
    marked = {_flat(t).get("name") for t in tools or [] if _flat(t).get("x-unsafe")}
    return set(spec_unsafe) | {n for n in marked if isinstance(n, str)}


class Sessions(Generic[T]):
    """Per-rollout state keyed by session id; ids never collide silently."""

    def __init__(self, env: str) -> None:
        self._env = env
        self._state: dict[str, T] = {}

    def open(self, session_id: str, state: T) -> None:
        if session_id in self._state:
            raise ValueError(f"{self._env}: session {session_id!r} is already open; close it "
                             f"first or use a fresh session id per rollout")
        self._state[session_id] = state

    def get(self, session_id: str) -> T:
        try:
            return self._state[session_id]
        except KeyError:
            raise KeyError(f"{self._env}: no open session {session_id!r}; call "
                           f"reset(session_id, spec) first") from None

    def close(self, session_id: str) -> None:
        self._state.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._state)
