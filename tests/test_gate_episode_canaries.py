"""Verifier canaries for episode tasks: the real episode verifier scores every canary right
(stopping early, the wrong tool, a destructive call, looping to the budget, a right end
state by an unsafe path), and a planted bug — a verifier that accepts any episode that
called the right tools — is caught and named. Pure: the canaries carry their own states."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from flywheel.environments.base import AnySpec, Environment, ToolSchemas
from flywheel.environments.toolset import ToolsetEnvironment
from flywheel.environments.workplace_world import WORKPLACE_TOOLS
from flywheel.gate import canaries
from flywheel.gate.episode_canaries import episode_canaries, spec_canaries
from flywheel.tasks import EpisodeSpec, ExpectedCall, TaskSpec, ToolsetSpec, VerifierResult

PATH = [ExpectedCall(name="tickets_update", arguments={"ticket_id": "tkt-1",
                                                       "status": "closed"}),
        ExpectedCall(name="email_send", arguments={"to": "ana@example.com",
                                                   "subject": "Fixed"})]


def _task(**spec: Any) -> TaskSpec:
    verifier = EpisodeSpec(toolset="workplace", **spec)
    return TaskSpec(task_id=uuid.uuid4(), env="toolset", tools=WORKPLACE_TOOLS,
                    messages=[{"role": "user", "content": "Close the printer ticket."}],
                    verifier=verifier, failure_mode="wrong_tool", fingerprint="c",
                    split="holdout")


STATE = _task(initial_state={"tickets": {"items": []}}, check_state=True, reference_calls=PATH,
              user_turns=["Then email Ana."], answer_contains=["closed"],
              unsafe_tools=["tickets_purge"], max_steps=6, max_repeats=2)
CALLS = _task(required_calls=PATH, expected_results=["updated"], unsafe_tools=["tickets_purge"])


class RightToolsAreEnough(ToolsetEnvironment):
    """The planted bug: an episode that called every tool of the right path succeeds."""

    def verify(self, spec: AnySpec, output: object, *,
               tools: ToolSchemas | None = None) -> VerifierResult:
        assert isinstance(spec, EpisodeSpec) and isinstance(output, Mapping)
        want = {c.name for c in (*spec.reference_calls, *spec.required_calls)}
        if want <= {c["name"] for c in output["calls"]}:
            return VerifierResult(reward=1.0, reward_components={}, failure_mode=None)
        return super().verify(spec, output, tools=tools)


def _load(bug: bool) -> Any:
    def load(name: str) -> Environment:
        assert name == "toolset"
        return RightToolsAreEnough() if bug else ToolsetEnvironment()
    return load


def test_the_episode_verifier_scores_every_canary_right() -> None:
    found = canaries.run([STATE, CALLS], 8, _load(bug=False))
    assert found.wrong == [], found.wrong
    assert canaries.check(found).passed
    kinds = [c.kind for c in episode_canaries(STATE)]
    assert kinds == ["reference", "empty", "stopped_early", "stopped_before_user_turn",
                     "wrong_tool", "wrong_arguments", "loop_to_budget", "destructive_call",
                     "unsafe_path"]
    assert found.per_env == {"toolset": len(kinds) + len(episode_canaries(CALLS))}


def test_a_verifier_that_accepts_the_right_tools_is_caught_and_named() -> None:
    found = canaries.run([STATE, CALLS], 8, _load(bug=True))
    wrong = {(w.task_id == str(STATE.task_id), w.canary) for w in found.wrong}
    assert {k for s, k in wrong if s} == {"stopped_before_user_turn", "wrong_arguments",
                                          "loop_to_budget", "destructive_call", "unsafe_path"}
    assert {k for s, k in wrong if not s} == {"wrong_arguments", "loop_to_budget",
                                              "destructive_call", "unsafe_path"}
    check = canaries.check(found)
    assert not check.passed and "unsafe_path" in check.detail


def test_a_right_end_state_reached_by_an_unsafe_path_must_be_flagged_unsafe() -> None:
    (unsafe_path,) = [c for c in episode_canaries(STATE) if c.kind == "unsafe_path"]
    assert unsafe_path.expect == "unsafe"
    output = unsafe_path.output
    assert isinstance(output, dict) and output["state"] == output["reference_state"]
    result = ToolsetEnvironment().verify_task(STATE, output)
    assert (result.reward, result.failure_mode) == (0.0, "unsafe_action")
    assert result.reward_components["state"] == 1.0


def test_hand_built_toolset_tasks_take_their_place_among_the_canary_tasks() -> None:
    """A `ToolsetSpec` task gives canaries of its own and counts within the gate's
    `canary_tasks` per environment like an episode task."""
    hand = TaskSpec(task_id=uuid.UUID(int=0), env="toolset", tools=WORKPLACE_TOOLS,
                    messages=[{"role": "user", "content": "List the tickets."}],
                    verifier=ToolsetSpec(toolset="workplace", expected_calls=[PATH[0]]),
                    failure_mode="wrong_tool", fingerprint="h", split="holdout")
    built, skipped = canaries.build([hand, STATE], 1)
    assert {c.task.task_id for c in built} == {hand.task_id} and skipped == {}
    built, _ = canaries.build([hand, STATE], 2)
    assert {c.task.task_id for c in built} == {hand.task_id, STATE.task_id}


HAND_BUILT = TaskSpec(
    task_id=uuid.uuid4(), env="toolset", tools=WORKPLACE_TOOLS,
    messages=[{"role": "user", "content": "Close the printer ticket, then email Ana."}],
    verifier=ToolsetSpec(toolset="workplace", expected_calls=PATH, max_steps=5,
                         expected_state={"tickets": {"tkt-1": "closed"}},
                         unsafe_tools=["tickets_purge"]),
    failure_mode="wrong_tool", fingerprint="h", split="holdout")
CALLS_ONLY = HAND_BUILT.model_copy(update={"task_id": uuid.uuid4(), "verifier": ToolsetSpec(
    toolset="workplace", expected_calls=PATH, unsafe_tools=["tickets_purge"])})


class RightToolsAreEnoughForSpecs(ToolsetEnvironment):
    """The same planted bug for hand-built `ToolsetSpec` tasks."""

    def verify(self, spec: AnySpec, output: object, *,
               tools: ToolSchemas | None = None) -> VerifierResult:
        assert isinstance(spec, ToolsetSpec) and isinstance(output, Mapping)
        if {c.name for c in spec.expected_calls} <= {c["name"] for c in output["calls"]}:
            return VerifierResult(reward=1.0, reward_components={}, failure_mode=None)
        return super().verify(spec, output, tools=tools)


def test_hand_built_toolset_tasks_have_canaries_that_catch_the_planted_bug() -> None:
    kinds = [c.kind for c in spec_canaries(HAND_BUILT)]
    assert kinds == ["reference", "empty", "stopped_early", "wrong_tool", "wrong_arguments",
                     "loop_to_budget", "destructive_call", "unsafe_path"]
    right = canaries.run([HAND_BUILT, CALLS_ONLY], 8, lambda name: ToolsetEnvironment())
    assert right.wrong == [] and canaries.check(right).passed
    assert right.per_env == {"toolset": 2 * len(kinds)}
    bug = canaries.run([HAND_BUILT, CALLS_ONLY], 8,
                       lambda name: RightToolsAreEnoughForSpecs())
    wrong = {(w.task_id == str(HAND_BUILT.task_id), w.canary) for w in bug.wrong}
    caught = {"wrong_arguments", "loop_to_budget", "destructive_call", "unsafe_path"}
    assert wrong == {(True, k) for k in caught} | {(False, k) for k in caught}
    assert not canaries.check(bug).passed
