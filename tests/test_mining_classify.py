"""Table-driven failure classifier tests: one row per failure mode, plus successes."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from flywheel.mining.build import Unverifiable, build_task, expected_calls
from flywheel.mining.classify import classify_failure
from flywheel.schemas import Trajectory, parse_trajectory
from flywheel.tasks import ExpectedCall, ToolCallSpec

TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer", "minimum": 1}},
        "required": ["city"], "additionalProperties": False}},
    {"type": "function", "name": "create_ticket", "parameters": {
        "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}},
    {"type": "function", "name": "delete_all_tickets", "x-unsafe": True,
     "parameters": {"type": "object", "properties": {}}},
]


def traj(calls: list[tuple[str, str, str]] | None = None, *, status: str = "failure",
         final: str | None = "Sorry.", outcome: dict[str, Any] | None = None) -> Trajectory:
    """calls: (name, raw arguments, output status)."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "user",
                                    "content": "Weather in Oslo for 2 days?"}]
    for n, (name, args, out_status) in enumerate(calls or []):
        items.append({"type": "function_call", "call_id": f"c{n}", "name": name,
                      "arguments": args})
        if out_status != "none":
            items.append({"type": "function_call_output", "call_id": f"c{n}", "output": "…",
                          "status": out_status})
    if final is not None:
        items.append({"type": "message", "role": "assistant", "content": final})
    return parse_trajectory({"trajectory_id": str(uuid.uuid4()), "agent": "a",
                             "session_id": "s1", "tools": TOOLS, "items": items,
                             "outcome": {"status": status, **(outcome or {})}})


OK_ARGS = '{"city": "Oslo", "days": 2}'
FIX = {"human_intervention": {"corrected_items": [{
    "type": "function_call", "call_id": "fix", "name": "get_weather", "arguments": OK_ARGS}]}}

CASES = [
    ("invalid_format", traj([("get_weather", '{"city": "Oslo"', "error")])),
    ("invalid_format", traj([], final='{"tool": "get_weather", "arguments": {"city": ')),
    ("wrong_tool", traj([("create_ticket", '{"title": "weather"}', "ok")], outcome=FIX)),
    ("bad_arguments", traj([("get_weather", '{"city": "Oslo", "days": 0}', "error")])),
    ("bad_arguments", traj([("get_weather", '{"town": "Oslo"}', "error")])),
    ("bad_arguments", traj([("get_weather", '{"city": "Bergen", "days": 2}', "ok")],
                           outcome=FIX)),
    ("hallucinated_tool", traj([("get_forecast", OK_ARGS, "error")])),
    ("unsafe_action", traj([("delete_all_tickets", "{}", "ok")])),
    ("tool_error", traj([("get_weather", OK_ARGS, "error")])),
    ("timeout", traj([("get_weather", OK_ARGS, "none")], status="timeout", final=None)),
    ("timeout", traj([("get_weather", OK_ARGS, "timeout")])),
    ("incomplete", traj([("get_weather", OK_ARGS, "none")], final=None)),
    ("incomplete", traj([], final="I think it will be sunny.")),
    ("escalated", traj([], status="escalated", final="Let me get a human.")),
    ("other", traj([("get_weather", OK_ARGS, "ok")], final="It is 3C.")),
]


@pytest.mark.parametrize(("mode", "t"), CASES, ids=[f"{m}-{i}" for i, (m, _) in
                                                    enumerate(CASES)])
def test_classifier_table(mode: str, t: Trajectory) -> None:
    found = expected_calls(t)
    c = classify_failure(t, found[0] if found else None)
    assert c.mode == mode, c.evidence
    assert c.evidence  # every classification records why


def test_every_failure_mode_is_covered_by_the_table() -> None:
    from flywheel.tasks import FAILURE_MODES

    assert {m for m, _ in CASES} == set(FAILURE_MODES)


def test_correction_becomes_the_expected_action_of_a_task() -> None:
    t = traj([("create_ticket", '{"title": "weather"}', "ok")], outcome=FIX)
    c = classify_failure(t, expected_calls(t)[0])  # type: ignore[index]
    task = build_task(t, c)
    assert not isinstance(task, Unverifiable)
    assert isinstance(task.verifier, ToolCallSpec)
    assert task.verifier.expected == ExpectedCall(name="get_weather",
                                                  arguments={"city": "Oslo", "days": 2})
    assert task.messages == [{"role": "user", "content": "Weather in Oslo for 2 days?"}]
    assert task.verifier.unsafe_tools == ["delete_all_tickets"]


def test_structured_feedback_is_an_expected_action() -> None:
    fb = json.dumps({"expected_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}})
    t = traj([("get_weather", '{"city": "Olso"}', "error")], outcome={"feedback": fb})
    found = expected_calls(t)
    assert found is not None and found[1] == "feedback"


def test_failure_without_any_way_to_verify_is_unverifiable_not_guessed() -> None:
    t = traj([("get_weather", OK_ARGS, "error")])
    assert isinstance(build_task(t, classify_failure(t)), Unverifiable)


def test_later_successful_retry_in_the_session_verifies_the_failure() -> None:
    failed = traj([("create_ticket", '{"title": "x"}', "ok")])
    retry = traj([("get_weather", OK_ARGS, "ok")], status="success", final="3C.")
    found = expected_calls(failed, retry)
    assert found is not None and found[1].startswith("retry:")
    c = classify_failure(failed, found[0])
    assert c.mode == "wrong_tool"
    task = build_task(failed, c, retry=retry)
    assert not isinstance(task, Unverifiable)


def test_near_identical_failures_share_a_fingerprint_and_split() -> None:
    a = traj([("create_ticket", '{"title": "weather"}', "ok")], outcome=FIX)
    b = traj([("create_ticket", '{"title":  "other"}', "error")], outcome=FIX)
    ta, tb = (build_task(t, classify_failure(t, expected_calls(t)[0]))  # type: ignore[index]
              for t in (a, b))
    assert not isinstance(ta, Unverifiable) and not isinstance(tb, Unverifiable)
    assert ta.fingerprint == tb.fingerprint and ta.task_id == tb.task_id
    assert ta.split == tb.split
