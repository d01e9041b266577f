"""Environment plugins load by name through entry points; reward profiles are pure."""

from __future__ import annotations

import pytest

from flywheel.environments import (
    Environment,
    UnknownEnvironment,
    available_environments,
    load_environment,
    profile_rewards,
)
from flywheel.environments.code import CodeEnvironment
from flywheel.environments.judge import JudgeEnvironment
from flywheel.environments.tool_call import ToolCallEnvironment
from flywheel.environments.toolset import ToolsetEnvironment
from flywheel.environments.workplace import WorkplaceEnvironment
from flywheel.tasks import (
    ExpectedCall,
    FailureMode,
    RolloutNotRun,
    ToolCallSpec,
    VerifierResult,
)


@pytest.mark.parametrize("name, cls", [("tool_call", ToolCallEnvironment),
                                       ("workplace", WorkplaceEnvironment),
                                       ("code", CodeEnvironment), ("judge", JudgeEnvironment),
                                       ("toolset", ToolsetEnvironment)])
def test_builtins_load_through_entry_points(name: str, cls: type[Environment]) -> None:
    env = load_environment(name)
    assert isinstance(env, cls)
    assert env.name == name
    assert load_environment(name) is not env  # a fresh instance: its own sessions


def test_unknown_environment_lists_the_available_ones() -> None:
    assert {"tool_call", "workplace", "code", "judge", "toolset"} <= set(
        available_environments())
    with pytest.raises(UnknownEnvironment, match="unknown environment 'chess'; available: "
                                                 "code, judge, tool_call, toolset, workplace"):
        load_environment("chess")


def test_single_step_environment_refuses_sessions() -> None:
    env = load_environment("tool_call")
    spec = ToolCallSpec(expected=ExpectedCall(name="f"))
    with pytest.raises(NotImplementedError, match="single-step"):
        env.reset("s", spec)


def test_spec_of_another_environment_is_refused() -> None:
    with pytest.raises(TypeError, match="verifies WorkplaceSpec, got ToolCallSpec"):
        load_environment("workplace").verify(ToolCallSpec(expected=ExpectedCall(name="f")), [])


def r(reward: float, mode: FailureMode | None = None) -> VerifierResult:
    return VerifierResult(reward=reward, reward_components={"a": reward}, failure_mode=mode)


def test_profile_rewards_hand_computed() -> None:
    results: list[VerifierResult | RolloutNotRun] = [
        r(1.0), r(0.0, "wrong_tool"), r(0.25, "bad_arguments"), r(0.75, "other"),
        RolloutNotRun("crash", "nothing"), RolloutNotRun("sandbox", "broken")]
    p = profile_rewards(results)
    assert p["count"] == 4
    assert p["not_run"] == {"count": 2, "by_kind": {"crash": 1, "sandbox": 1}}
    assert p["mean"] == 0.5
    assert p["std"] == pytest.approx(((0.25 + 0.25 + 0.0625 + 0.0625) / 4) ** 0.5)
    assert (p["min"], p["max"]) == (0.0, 1.0)
    assert p["histogram"]["counts"] == [1, 0, 1, 0, 0, 0, 0, 1, 0, 1]
    assert len(p["histogram"]["edges"]) == 11
    assert p["failure_modes"] == {"bad_arguments": 0.25, "none": 0.25, "other": 0.25,
                                  "wrong_tool": 0.25}
    assert p["exact_success"] == 0.25
    assert p["components"] == {"a": 0.5}


def test_profile_of_nothing_has_no_statistics() -> None:
    p = profile_rewards([])
    assert (p["count"], p["mean"], p["std"], p["exact_success"]) == (0, None, None, None)
    assert p["histogram"]["counts"] == [0] * 10
