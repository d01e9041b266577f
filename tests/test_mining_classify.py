"""Table-driven failure classifier tests: one row per failure mode, plus successes."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from flywheel.mining.build import Unverifiable, build_task, expected_calls, fingerprint
from flywheel.mining.classify import classify_failure
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec
from flywheel.trajectory import Trajectory, parse_trajectory

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
    assert task.verifier.expected == [ExpectedCall(name="get_weather",
                                                   arguments={"city": "Oslo", "days": 2})]
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


def test_single_call_fingerprint_did_not_change_with_the_list_shape() -> None:
    # Computed by the one-object `expected` shape before several calls were possible: stored
    # tasks dedupe against new failures only if this stays put.
    v = ToolCallSpec(expected=[ExpectedCall(name="get_weather",
                                            arguments={"city": "Oslo", "days": 2})],
                     unsafe_tools=["delete_all_tickets"])
    fp = fingerprint("tool_call", [{"role": "user", "content": "Weather in Oslo for 2 days?"}],
                     ["get_weather", "create_ticket", "delete_all_tickets"], v)
    assert fp == "946ab0a8c89c708a8187c04b452aa33beaf1783d601c4e795e4f7f3c873a07f1"
    a, b = ExpectedCall(name="get_weather", arguments={"city": "Oslo"}), \
        ExpectedCall(name="create_ticket", arguments={"title": "x"})
    msgs = [{"role": "user", "content": "hi"}]
    both = [fingerprint("tool_call", msgs, ["get_weather"], ToolCallSpec(expected=calls))
            for calls in ([a, b], [b, a], [a])]
    assert both[0] == both[1] != both[2]  # parallel calls: order-free identity


def test_task_stored_before_several_calls_still_loads() -> None:
    old = {"task_id": str(uuid.uuid4()), "env": "tool_call", "messages": [
        {"role": "user", "content": "Weather?"}], "tools": TOOLS,
        "verifier": {"kind": "tool_call", "expected": {"name": "get_weather",
                                                       "arguments": {"city": "Oslo"}},
                     "unsafe_tools": ["delete_all_tickets"]},
        "failure_mode": "bad_arguments", "fingerprint": "f" * 64, "split": "holdout"}
    task = TaskSpec.model_validate_json(json.dumps(old))
    assert isinstance(task.verifier, ToolCallSpec)
    assert [c.name for c in task.verifier.expected] == ["get_weather"]


def _items(*parts: Any) -> list[dict[str, Any]]:
    """("call", name, args) / ("out", call_id) / ("say", text) → v1 items after a request."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "user",
                                    "content": "Weather in Oslo and Lima?"}]
    for n, part in enumerate(parts):
        if part[0] == "call":
            items.append({"type": "function_call", "call_id": f"k{n}", "name": part[1],
                          "arguments": json.dumps(part[2])})
        elif part[0] == "out":
            items.append({"type": "function_call_output", "call_id": part[1], "output": "…",
                          "status": "ok"})
        else:
            items.append({"type": "message", "role": "assistant", "content": part[1]})
    return items


def _traj(items: list[dict[str, Any]], status: str = "failure",
          outcome: dict[str, Any] | None = None) -> Trajectory:
    return parse_trajectory({"trajectory_id": str(uuid.uuid4()), "agent": "a",
                             "session_id": "s1", "tools": TOOLS, "items": items,
                             "outcome": {"status": status, **(outcome or {})}})


OSLO, LIMA = {"city": "Oslo"}, {"city": "Lima"}


def _fn(name: str, args: dict[str, Any], n: int = 0) -> dict[str, Any]:
    return {"type": "function_call", "call_id": f"fix{n}", "name": name,
            "arguments": json.dumps(args)}


def test_correction_with_several_calls_expects_all_of_them() -> None:
    failed = _traj(_items(("call", "get_weather", OSLO), ("out", "k1"), ("say", "Sunny.")),
                   outcome={"human_intervention": {"corrected_items": [
                       _fn("get_weather", OSLO), _fn("get_weather", LIMA, 1)]}})
    found = expected_calls(failed)
    assert found is not None and len(found[0]) == 2
    c = classify_failure(failed, found[0])
    assert c.mode == "incomplete"  # the Lima call was never made
    task = build_task(failed, c)
    assert not isinstance(task, Unverifiable) and isinstance(task.verifier, ToolCallSpec)
    assert [e.arguments for e in task.verifier.expected] == [OSLO, LIMA]
    assert task.messages == [{"role": "user", "content": "Weather in Oslo and Lima?"}]


def test_retry_with_a_parallel_turn_expects_the_whole_turn() -> None:
    failed = _traj(_items(("call", "get_weather", OSLO), ("out", "k1"), ("say", "Sunny.")),
                   outcome={"feedback": "wrong: I asked for two cities"})
    retry = _traj(_items(("call", "get_weather", LIMA), ("call", "get_weather", OSLO),
                         ("out", "k1"), ("out", "k2"), ("call", "create_ticket", {"title": "t"}),
                         ("out", "k5"), ("say", "Done.")), status="success")
    task = build_task(failed, classify_failure(failed, expected_calls(failed, retry)[0]),  # type: ignore[index]
                      retry=retry)
    assert not isinstance(task, Unverifiable) and isinstance(task.verifier, ToolCallSpec)
    # The first turn only: the ticket comes after the weather results, in a later turn.
    assert [e.arguments for e in task.verifier.expected] == [LIMA, OSLO]


def test_later_turn_of_a_sequence_expects_what_is_left_of_the_correction() -> None:
    failed = _traj(_items(("call", "get_weather", OSLO), ("out", "k1"),
                          ("call", "create_ticket", {"title": "wrong"}), ("out", "k3"),
                          ("say", "Done.")),
                   outcome={"human_intervention": {"corrected_items": [
                       _fn("get_weather", OSLO), _fn("create_ticket", {"title": "Oslo"}, 1)]}})
    c = classify_failure(failed, expected_calls(failed)[0])  # type: ignore[index]
    assert (c.mode, c.step) == ("bad_arguments", 3)
    task = build_task(failed, c)
    assert not isinstance(task, Unverifiable) and isinstance(task.verifier, ToolCallSpec)
    assert task.verifier.expected == [ExpectedCall(name="create_ticket",
                                                   arguments={"title": "Oslo"})]
    assert [m["role"] for m in task.messages] == ["user", "assistant", "tool"]


@pytest.mark.parametrize("as_object", [False, True])
def test_feedback_with_several_calls_and_possible_answers(as_object: bool) -> None:
    fb: dict[str, Any] = {"expected_calls": [
        {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2},
         "alternatives": {"city": ["Oslo, Norway"]}, "optional": ["days"]},
        {"name": "get_weather", "arguments": '{"city": "Lima"}'}]}
    failed = _traj(_items(("call", "get_weather", {"city": "Oslo, Norway"}), ("out", "k1"),
                          ("say", "Sunny.")))
    # Another engineer lets feedback be an object; until then it is a JSON string.
    object.__setattr__(failed.outcome, "feedback", fb if as_object else json.dumps(fb))
    found = expected_calls(failed)
    assert found is not None and found[1] == "feedback"
    c = classify_failure(failed, found[0])
    assert c.mode == "incomplete"  # the alternative spelling is right; Lima is missing
    task = build_task(failed, c)
    assert not isinstance(task, Unverifiable) and isinstance(task.verifier, ToolCallSpec)
    first, second = task.verifier.expected
    assert first.alternatives == {"city": ["Oslo, Norway"]} and first.optional == ["days"]
    assert second.arguments == {"city": "Lima"}


def test_correction_breaking_its_tool_schema_is_unverifiable() -> None:
    failed = _traj(_items(("call", "get_weather", {"city": "Oslo", "days": 0}), ("out", "k1"),
                          ("say", "Hm.")),
                   outcome={"human_intervention": {"corrected_items": [
                       _fn("get_weather", {"city": "Oslo", "days": "2"})]}})
    task = build_task(failed, classify_failure(failed, expected_calls(failed)[0]))  # type: ignore[index]
    assert isinstance(task, Unverifiable) and "own check" in task.reason
    unsafe = _traj(_items(("call", "get_weather", OSLO), ("out", "k1"), ("say", "Hm.")),
                   outcome={"human_intervention": {"corrected_items": [
                       _fn("delete_all_tickets", {})]}})
    task = build_task(unsafe, classify_failure(unsafe, expected_calls(unsafe)[0]))  # type: ignore[index]
    assert isinstance(task, Unverifiable) and "unsafe" in task.reason


def _conversation(*requests: tuple[str, list[dict[str, Any]], str]) -> list[dict[str, Any]]:
    """(user request, calls as (name, arguments) dicts, answer) per request."""
    items: list[dict[str, Any]] = []
    for r, (text, calls, answer) in enumerate(requests):
        items.append({"type": "message", "role": "user", "content": text})
        for n, call in enumerate(calls):
            items += [{"type": "function_call", "call_id": f"r{r}c{n}", "name": call["name"],
                       "arguments": json.dumps(call["arguments"])},
                      {"type": "function_call_output", "call_id": f"r{r}c{n}", "output": "ok",
                       "status": "ok"}]
        items.append({"type": "message", "role": "assistant", "content": answer})
    return items


W_OSLO = {"name": "get_weather", "arguments": OSLO}
W_LIMA = {"name": "get_weather", "arguments": LIMA}
TICKET = {"name": "create_ticket", "arguments": {"title": "printer"}}
PATH = {"human_intervention": {"corrected_items": [
    _fn("get_weather", OSLO), _fn("get_weather", LIMA, 1),
    _fn("create_ticket", {"title": "printer"}, 2)]}}


def _mined(items: list[dict[str, Any]], outcome: dict[str, Any]) -> TaskSpec | Unverifiable:
    failed = _traj(items, outcome=outcome)
    found = expected_calls(failed)
    assert found is not None
    return build_task(failed, classify_failure(failed, found[0]))


@pytest.mark.parametrize("second", [
    ([], "Done, that is taken care of."),                                # stopped short
    ([{"name": "get_weather", "arguments": {"city": "Lim"}}], "Cloudy."),  # a wrong argument
])
def test_a_conversation_failed_in_its_second_request_expects_that_requests_call_there(
        second: tuple[list[dict[str, Any]], str]) -> None:
    """A whole-conversation path (no turn boundaries): the failed request is the one whose
    calls left the path while the others' are the path's; the task is put after the
    conversation before that decision and expects that request's calls alone — never the
    later requests' (before: the first request's prompt, all three calls expected)."""
    calls, answer = second
    task = _mined(_conversation(("Weather in Oslo?", [W_OSLO], "Sunny."),
                                ("And in Lima?", calls, answer),
                                ("Open a ticket: printer.", [TICKET], "Opened.")), PATH)
    assert isinstance(task, TaskSpec) and isinstance(task.verifier, ToolCallSpec)
    assert [(e.name, e.arguments) for e in task.verifier.expected] == [("get_weather", LIMA)]
    assert [m["role"] for m in task.messages] == ["user", "assistant", "tool", "assistant",
                                                  "user"]
    assert task.messages[-1]["content"] == "And in Lima?"


def test_a_conversation_whose_path_fits_two_requests_equally_is_unverifiable() -> None:
    task = _mined(_conversation(("Weather in Oslo?", [], "Done."),
                                ("And in Lima?", [], "Done.")),
                  {"human_intervention": {"corrected_items": [_fn("get_weather", LIMA)]}})
    assert isinstance(task, Unverifiable) and "requests that fit equally: #1 and #2" in task.reason


def test_a_conversation_that_made_every_expected_call_fails_in_no_call() -> None:
    task = _mined(_conversation(("Weather in Oslo?", [W_OSLO], "Sunny."),
                                ("And in Lima?", [W_LIMA], "Snowing, probably.")),
                  {"human_intervention": {"corrected_items": [
                      _fn("get_weather", OSLO), _fn("get_weather", LIMA, 1)]}})
    assert isinstance(task, Unverifiable) and "every expected call was made" in task.reason
