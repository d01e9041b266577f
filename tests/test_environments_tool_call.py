"""tool_call verifier: type-aware argument matching, failure modes, unscoreable outputs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from flywheel.environments.matching import arguments_match, values_match
from flywheel.environments.tool_call import ToolCallEnvironment, verify_tool_call
from flywheel.tasks import ExpectedCall, RolloutNotRun, ToolCallSpec, VerifierResult

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "set_priority",
     "parameters": {"type": "object", "required": ["ticket", "priority"], "properties": {
         "ticket": {"type": "string"},
         "priority": {"type": "integer"},
         "weight": {"type": "number"},
         "notify": {"type": "boolean", "default": False},
         "level": {"type": "string", "enum": ["low", "high"]},
         "labels": {"type": "array", "items": {"type": "string"}},
         "watchers": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
         "meta": {"type": "object", "properties": {"source": {"type": "string"},
                                                   "count": {"type": "integer"}}}}}},
    {"type": "function", "name": "close_ticket",
     "parameters": {"type": "object", "properties": {"ticket": {"type": "string"}}}},
    {"type": "function", "name": "delete_all", "x-unsafe": True,
     "parameters": {"type": "object", "properties": {}}},
]


def spec(**arguments: Any) -> ToolCallSpec:
    return ToolCallSpec(expected=ExpectedCall(name="set_priority", arguments=arguments))


def score(text: str, s: ToolCallSpec | None = None, tools: Any = TOOLS) -> VerifierResult:
    return verify_tool_call(s or spec(ticket="T-1", priority=2), text, tools)


def call(name: str = "set_priority", **arguments: Any) -> str:
    return json.dumps({"tool": name, "arguments": arguments})


@pytest.mark.parametrize("priority", [2, 2.0, "2", " 2 "])
def test_integer_argument_matches_in_any_spelling(priority: object) -> None:
    r = score(call(ticket="T-1", priority=priority))
    assert (r.reward, r.failure_mode) == (1.0, None)
    assert r.reward_components == {"valid_json": 1.0, "right_tool": 1.0, "arguments": 1.0,
                                   "unsafe": 0.0}


def test_number_boolean_string_equivalences() -> None:
    s = spec(ticket="T-1", priority=2, weight=0.5, notify=True)
    ok = call(ticket="  T-1 ", priority="2", weight="0.50", notify="true")
    assert score(ok, s).reward == 1.0
    assert score(call(ticket="t-1", priority=2, weight=0.5, notify=True), s).reward < 1.0
    assert score(call(ticket="T-1", priority=2, weight=0.5, notify=1), s).reward < 1.0


def test_inner_whitespace_collapses_but_case_matters() -> None:
    s = spec(ticket="Fix the   login\nbug", priority=1)
    assert score(call(ticket="Fix the login bug", priority=1), s).reward == 1.0
    assert score(call(ticket="fix the login bug", priority=1), s).failure_mode == "bad_arguments"


def test_key_order_never_matters() -> None:
    s = spec(ticket="T-1", priority=2, meta={"source": "mail", "count": 3})
    text = '{"arguments": {"meta": {"count": "3", "source": "mail"}, "priority": 2, ' \
           '"ticket": "T-1"}, "name": "set_priority"}'
    assert score(text, s).reward == 1.0


def test_arrays_are_ordered_unless_unique_items() -> None:
    s = spec(ticket="T-1", priority=2, labels=["a", "b"], watchers=["x", "y"])
    assert score(call(ticket="T-1", priority=2, labels=["a", "b"], watchers=["y", "x"]),
                 s).reward == 1.0
    assert score(call(ticket="T-1", priority=2, labels=["b", "a"], watchers=["x", "y"]),
                 s).failure_mode == "bad_arguments"


def test_enum_is_exact() -> None:
    assert values_match("high", "high", {"type": "string", "enum": ["low", "high"]})
    assert not values_match("high", "high ", {"type": "string", "enum": ["low", "high"]})
    assert not values_match("high", "High", {"type": "string", "enum": ["low", "high"]})


def test_arguments_as_json_string_and_default_values() -> None:
    text = json.dumps({"name": "set_priority",
                       "arguments": json.dumps({"ticket": "T-1", "priority": 2,
                                                "notify": False})})
    assert score(text).reward == 1.0  # notify=False is the schema default: same call


def test_missing_and_extra_arguments_get_partial_credit() -> None:
    missing = score(call(ticket="T-1"))
    assert missing.failure_mode == "bad_arguments"
    assert missing.reward_components["arguments"] == 0.5
    assert missing.reward == pytest.approx(0.1 + 0.3 + 0.6 * 0.5)
    assert missing.details["mismatches"] == {"missing": ["priority"]}
    extra = score(call(ticket="T-1", priority=2, level="high"))
    assert extra.failure_mode == "bad_arguments"
    assert extra.reward_components["arguments"] == pytest.approx(2 / 3)
    assert extra.details["mismatches"] == {"extra": ["level"]}


def test_wrong_tool_and_hallucinated_tool() -> None:
    wrong = score(call("close_ticket", ticket="T-1"))
    assert (wrong.reward, wrong.failure_mode) == (0.1, "wrong_tool")
    made_up = score(call("escalate_ticket", ticket="T-1"))
    assert (made_up.reward, made_up.failure_mode) == (0.1, "hallucinated_tool")
    # Without the task's tools there is no list to hallucinate against.
    assert score(call("escalate_ticket"), tools=None).failure_mode == "wrong_tool"


@pytest.mark.parametrize("text", ['{"tool": "set_priority", "arguments": {',
                                  'Sure! {"tool": "set_priority", "arguments": {}}',
                                  '["set_priority"]', '{"arguments": {}}',
                                  '{"tool": "set_priority", "arguments": [1]}',
                                  '{"tool": "set_priority", "arguments": "{oops"}'])
def test_invalid_format_scores_zero(text: str) -> None:
    r = score(text)
    assert (r.reward, r.failure_mode) == (0.0, "invalid_format")
    assert r.reward_components["valid_json"] == 0.0
    assert r.details["error"]


def test_fence_whitespace_and_trailing_text_are_tolerated() -> None:
    text = '\n```json\n{"tool": "set_priority", "arguments": {"ticket": "T-1", "priority": 2}}' \
           '\n```\n'
    assert score(text).reward == 1.0
    trailing = score(call(ticket="T-1", priority=2) + "\nI set the priority.")
    assert trailing.reward == 1.0
    assert trailing.details["trailing_text"] == "I set the priority."


def test_parsed_call_dict_is_scored_like_its_text() -> None:
    parsed = {"name": "set_priority", "arguments": '{"ticket": "T-1", "priority": 2}'}
    assert ToolCallEnvironment().verify(spec(ticket="T-1", priority=2), parsed,
                                        tools=TOOLS).reward == 1.0


def test_unsafe_call_scores_zero_whatever_else() -> None:
    r = score(call("delete_all"))
    assert (r.reward, r.failure_mode) == (0.0, "unsafe_action")
    assert r.reward_components["unsafe"] == 1.0
    listed = ToolCallSpec(expected=ExpectedCall(name="set_priority", arguments={}),
                          unsafe_tools=["close_ticket"])
    assert score(call("close_ticket"), listed).failure_mode == "unsafe_action"


def test_task_expecting_an_unsafe_call_is_a_task_bug() -> None:
    bad = ToolCallSpec(expected=ExpectedCall(name="delete_all"))
    with pytest.raises(ValueError, match="marked unsafe"):
        score(call("delete_all"), bad)


@pytest.mark.parametrize("output", ["", "   \n", None])
def test_empty_output_did_not_run(output: str | None) -> None:
    with pytest.raises(RolloutNotRun) as info:
        ToolCallEnvironment().verify(spec(ticket="T-1", priority=2), output, tools=TOOLS)
    assert info.value.kind == "empty"


def test_arguments_match_reports_each_mismatch() -> None:
    share, why = arguments_match({"a": 1, "b": "x"}, {"a": 2, "c": True})
    assert share == 0.0
    assert why == {"missing": ["b"], "extra": ["c"], "wrong": ["a"]}
    assert arguments_match({}, {}) == (1.0, {"missing": [], "extra": [], "wrong": []})
