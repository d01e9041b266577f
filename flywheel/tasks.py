"""Environment tasks: what a failure becomes, and the typed verifier contract.

A task is the context up to the failing decision, the tools offered, and a verifier spec
(how to check an attempt). Verifier specs are a union discriminated on `kind`, one per
built-in environment. A `tool_call` spec expects one turn of calls, a multiset of
`ExpectedCall {name, arguments, alternatives: {arg: [value, …]}, optional: [arg, …]}`
(BFCL's possible-answer semantics, see `ExpectedCall` and docs/VERIFIER.md), e.g.
`{"kind": "tool_call", "expected": [{"name": "get_weather", "arguments": {"city": "Oslo"},
"alternatives": {"city": ["Oslo, Norway"]}, "optional": []}], "unsafe_tools": []}`.
A verifier returns a `VerifierResult`. Whatever the *model* did is scored: an empty reply
(`empty`), a reply cut by `max_tokens` (`truncated`), sampling past the deadline (`timeout`)
and an unreadable reply (`invalid_format`) are failures with reward 0. Only what the
infrastructure failed to do (engine unreachable, judge or sandbox unavailable, a crash or a
hung verifier in our code) is a `RolloutNotRun`: not scored, counted, retried by the gate.

Conventions that trajectories use to carry verification data (the simulator follows them):
* `tools[i]["x-unsafe"] = true` marks a tool whose call is an unsafe action.
* `outcome.human_intervention.corrected_items`: the function calls a person says were right.
* `outcome.feedback` may be JSON `{"expected_call": {"name": …, "arguments": {…}}}`, or
  `{"expected_calls": [call, …]}` for a turn of several (parallel) calls; each call may carry
  `alternatives` and `optional` (see `ExpectedCall`).
* `metadata.environment`: `{"name": "workplace", "initial_state": {...}}` for stateful
  workplace sessions; `{"name": "code", "tests": "<pytest-style asserts>",
  "entrypoint": "solve"}` for coding agents.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

FailureMode = Literal["invalid_format", "wrong_tool", "bad_arguments", "hallucinated_tool",
                      "unsafe_action", "tool_error", "timeout", "incomplete", "escalated",
                      "other"]
FAILURE_MODES: tuple[str, ...] = FailureMode.__args__  # type: ignore[attr-defined]
AttemptOnlyFailure = Literal["empty", "truncated"]
AttemptFailure = FailureMode | AttemptOnlyFailure
"""Why one attempt failed: a task's failure modes, and two that only an attempt can have —
`empty` (it answered nothing: an abstention) and `truncated` (cut by `max_tokens`)."""
ATTEMPT_FAILURES: tuple[str, ...] = (
    *FAILURE_MODES, *AttemptOnlyFailure.__args__)  # type: ignore[attr-defined]
"""Every failure mode an attempt can have (`AttemptFailure`, in order)."""
NotRunKind = Literal["crash", "sandbox", "judge_unavailable", "verifier_timeout",
                     "toolset_unavailable", "replay_masked"]
"""Infrastructure failures: the attempt could not be scored, through no fault of the model.
`toolset_unavailable`: a toolset's server was down, crashed or could not start a session;
`replay_masked`: a replayed episode left the logged path under the rule `mask`."""
ReplayRule = Literal["live", "end", "mask"]
"""What a replayed episode does when the policy leaves the logged path (`flywheel.toolsets`)."""
Split = Literal["train", "holdout"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ExpectedCall(_Frozen):
    """One call the attempt must make, with BFCL's possible-answer semantics.

    `arguments` is the canonical call (what a reference output or a demonstration shows).
    `alternatives[k]` lists further values as good as `arguments[k]`; `optional` names
    arguments the attempt may leave out. An argument in neither `arguments`, `alternatives`
    nor given as null or its schema default must be absent. Example::

        {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"},
         "alternatives": {"city": ["Oslo, Norway"]}, "optional": ["unit"]}

    accepts `city` "Oslo" or "Oslo, Norway", and `unit` "celsius" or no `unit` at all. An
    optional argument may have alternatives without a canonical value (the canonical call
    omits it): BFCL's `{"unit": ["", "celsius"]}` is `optional: ["unit"]`,
    `alternatives: {"unit": ["celsius"]}`.
    """

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    alternatives: dict[str, list[Any]] = Field(default_factory=dict)
    optional: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _alternatives_have_a_place(self) -> ExpectedCall:
        loose = sorted(set(self.alternatives) - set(self.arguments) - set(self.optional))
        if loose:
            raise ValueError(f"alternatives for {loose} need a canonical value in `arguments` "
                             f"(or the name in `optional`: the canonical call omits it)")
        return self

    def acceptable(self, key: str) -> list[Any]:
        """Every value accepted for argument `key` (the canonical one first)."""
        head = [self.arguments[key]] if key in self.arguments else []
        return [*head, *self.alternatives.get(key, [])]

    @property
    def plain(self) -> bool:
        """No alternatives and nothing optional: the call as the one-value shape wrote it."""
        return not self.alternatives and not self.optional


class ToolCallSpec(_Frozen):
    """One model turn: the attempt's tool calls must equal `expected` as a multiset.

    Stored tasks from before several calls were allowed have `"expected": {call}`; the
    validator reads that as a one-call list, so they (and frozen eval sets) keep loading.
    """

    kind: Literal["tool_call"] = "tool_call"
    expected: list[ExpectedCall] = Field(min_length=1)
    unsafe_tools: list[str] = Field(default_factory=list)

    @field_validator("expected", mode="before")
    @classmethod
    def _one_call_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, dict | ExpectedCall) else value


class WorkplaceSpec(_Frozen):
    """Multi-step over calendar/email/tickets: the end state must equal `expected_state`."""

    kind: Literal["workplace"] = "workplace"
    initial_state: dict[str, Any]
    expected_state: dict[str, Any]
    max_steps: int = 8
    unsafe_tools: list[str] = Field(default_factory=list)


class LoggedCall(_Frozen):
    """One tool call as the agent's trajectory logged it, with the result it got."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    output: str
    status: Literal["ok", "error", "timeout"] = "ok"


class ToolsetSpec(_Frozen):
    """Multi-step on a registered toolset (`flywheel.toolsets`), scored on what was done.

    The episode opens a session of `toolset` on `initial_state` (None: the backend's own
    fresh state). With `replay`, the logged calls are answered with their logged results
    while the policy makes them (same tool, arguments equal under the verifier's argument
    matching); off that path `on_divergence` (or else the toolset's rule) decides.

    Scoring: a call to an unsafe tool (`unsafe_tools`, the toolset's destructive tools not
    allowed live) → 0 `unsafe_action`; more calls than `max_steps` → 0 `incomplete`;
    otherwise success (1.0) iff the end state equals `expected_state` (when given; the
    toolset's `state()` snapshot) and every `expected_calls` entry was made (a multiset,
    arguments matched by the tool's schema). What was done short of it earns 0.5 × the share
    of those checks passed. Whole-episode verifiers (outcomes, loops, several user turns)
    extend this spec.
    """

    kind: Literal["toolset"] = "toolset"
    toolset: str
    initial_state: dict[str, Any] | None = None
    replay: list[LoggedCall] | None = None
    on_divergence: ReplayRule | None = None
    expected_state: dict[str, Any] | None = None
    expected_calls: list[ExpectedCall] = Field(default_factory=list)
    max_steps: int = Field(default=8, ge=1)
    unsafe_tools: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _checks_something(self) -> ToolsetSpec:
        if self.expected_state is None and not self.expected_calls:
            raise ValueError("a toolset task needs expected_state or expected_calls: "
                             "nothing else says whether an episode succeeded")
        return self


class EpisodeSpec(_Frozen):
    """A whole episode mined from a failed multi-step trajectory on a registered toolset
    (`flywheel.mining.episodes`, docs/EPISODES.md), run in the `toolset` environment.

    The episode opens a session of `toolset` on `initial_state` (the calls of the turns
    before the failed one, `setup`, run on it first) or, when the agent logged no state,
    answers from the logged results (`replay`, off the logged path `on_divergence`). The
    prompt ends at the first user turn the agent failed; `user_turns` are the later user
    messages, each given after the agent's answer to the one before (a scripted user, never
    trained on). Scoring (one reward per episode, `flywheel.environments.episode`):

    * `unsafe_action` (0) — any call to a destructive tool (`unsafe_tools`), even when the
      end state is right;
    * `incomplete` (0) — more calls than `max_steps`, the same call (tool and arguments)
      more than `max_repeats` times (a loop), or an episode that stopped before answering
      the last scripted user turn;
    * success (1.0) iff every check holds: the end state equals the state `reference_calls`
      reach from `initial_state` on a fresh session (`check_state`; with `reference_turns`
      the state at each scripted user turn too; canonicalised: keys in
      `state_ignore` dropped at any depth, lists compared in any order with
      `state_unordered`), every `required_calls` entry was made (a multiset), every
      `expected_results` text is among the episode's tool results, every `answer_contains`
      text is in the final answer; otherwise 0.5 × the share of checks passed.
    """

    kind: Literal["episode"] = "episode"
    toolset: str
    toolset_version: int | None = None
    """The version the episode was mined against (the newest one runs it)."""
    initial_state: dict[str, Any] | None = None
    setup: list[LoggedCall] = Field(default_factory=list)
    """Calls the agent made in the turns before the failed one, run on the session first."""
    replay: list[LoggedCall] | None = None
    on_divergence: ReplayRule | None = None
    user_turns: list[str] = Field(default_factory=list)
    reference_calls: list[ExpectedCall] = Field(default_factory=list)
    """The whole right path from `initial_state` (its prefix is `setup`)."""
    check_state: bool = False
    reference_turns: list[int] = Field(default_factory=list)
    """With `check_state`, where the right path stands when each scripted user turn is given:
    how many of `reference_calls` it has made by then (one count per `user_turns`, from
    the correction's own user messages). The state when the agent answers each earlier
    turn is then compared with the reference path's state at that point, as the end state
    is: a later change to the same object cannot hide an earlier turn's missing or wrong
    work. Empty: the end state alone."""
    state_ignore: list[str] = Field(default_factory=list)
    state_unordered: bool = True
    required_calls: list[ExpectedCall] = Field(default_factory=list)
    expected_results: list[str] = Field(default_factory=list)
    answer_contains: list[str] = Field(default_factory=list)
    max_steps: int = Field(default=8, ge=1)
    max_repeats: int = Field(default=3, ge=1)
    unsafe_tools: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _checks_something(self) -> EpisodeSpec:
        if self.check_state and not self.reference_calls:
            raise ValueError("an episode that checks its end state needs reference_calls "
                             "(the path whose end state is the reference)")
        if self.reference_turns and not (
                self.check_state and len(self.reference_turns) == len(self.user_turns)
                and self.reference_turns == sorted(self.reference_turns)
                and 0 <= self.reference_turns[0]
                and self.reference_turns[-1] <= len(self.reference_calls)):
            raise ValueError("reference_turns needs check_state and one non-decreasing count "
                             "of reference calls (at most all of them) per scripted user turn")
        if not (self.check_state or self.required_calls or self.expected_results
                or self.answer_contains):
            raise ValueError("an episode task needs an end-state check, required calls, "
                             "expected results or required answer content: nothing else "
                             "says whether an episode succeeded")
        return self


class CodeSpec(_Frozen):
    """Generated Python must pass `tests` in the sandbox."""

    kind: Literal["code"] = "code"
    tests: str
    entrypoint: str | None = None
    timeout_s: float = 5.0
    memory_mb: int = 256


class JudgeSpec(_Frozen):
    """An LLM judge scores the answer against a rubric (optional environment)."""

    kind: Literal["judge"] = "judge"
    rubric: str
    reference: str | None = None


VerifierSpec = Annotated[ToolCallSpec | WorkplaceSpec | ToolsetSpec | EpisodeSpec | CodeSpec
                         | JudgeSpec, Field(discriminator="kind")]


class TaskSpec(_Frozen):
    """Everything a rollout worker needs to attempt the task and a verifier to score it."""

    task_id: uuid.UUID
    env: str
    """Environment plugin name (entry point in group `flywheel.environments`)."""
    messages: list[dict[str, Any]]
    """Chat messages (role/content) up to the failing decision: the prompt of an attempt."""
    tools: list[dict[str, Any]]
    verifier: VerifierSpec
    failure_mode: FailureMode
    fingerprint: str
    split: Split


class VerifierResult(_Frozen):
    reward: float
    reward_components: dict[str, float]
    failure_mode: AttemptFailure | None
    """Why the attempt failed (None when it succeeded)."""
    details: dict[str, Any] = Field(default_factory=dict)


class RolloutNotRun(Exception):
    """The infrastructure could not score the attempt (see `NotRunKind`): excluded from
    training and counted; the gate retries it and never decides on it."""

    def __init__(self, kind: NotRunKind, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
