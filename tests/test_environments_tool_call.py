"""tool_call verifier: strict schema types, BFCL possible answers, several calls, outputs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from flywheel.environments.calls import Call
from flywheel.environments.matching import arguments_match, fold_text, values_match
from flywheel.environments.scoring import best_assignment
from flywheel.environments.tool_call import ToolCallEnvironment, verify_calls, verify_tool_call
from flywheel.tasks import ExpectedCall, ToolCallSpec, VerifierResult

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
         "ref": {"type": "string", "pattern": "^T-[0-9]+$"},
         "meta": {"type": "object", "properties": {"source": {"type": "string"},
                                                   "count": {"type": "integer"}}}}}},
    {"type": "function", "name": "close_ticket",
     "parameters": {"type": "object", "properties": {"ticket": {"type": "string"}}}},
    {"type": "function", "name": "delete_all", "x-unsafe": True,
     "parameters": {"type": "object", "properties": {}}},
]


def spec(**arguments: Any) -> ToolCallSpec:
    return ToolCallSpec(expected=[ExpectedCall(name="set_priority", arguments=arguments)])


def score(text: str, s: ToolCallSpec | None = None, tools: Any = TOOLS) -> VerifierResult:
    return verify_tool_call(s or spec(ticket="T-1", priority=2), text, tools)


def call(name: str = "set_priority", **arguments: Any) -> str:
    return json.dumps({"tool": name, "arguments": arguments})


def message(*calls: tuple[str, Any], content: str | None = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"c{n}", "type": "function", "function": {"name": name, "arguments": args}}
        for n, (name, args) in enumerate(calls)]}


def test_integer_argument_is_a_json_integer_only() -> None:
    ok = score(call(ticket="T-1", priority=2))
    assert (ok.reward, ok.failure_mode) == (1.0, None)
    assert ok.reward_components == {"valid_json": 1.0, "right_tool": 1.0, "arguments": 1.0,
                                    "unsafe": 0.0}
    # Strict since BFCL alignment: "2", " 2 " and 2.0 used to count as 2.
    for spelled in ("2", " 2 ", 2.0, True):
        r = score(call(ticket="T-1", priority=spelled))
        assert r.failure_mode == "bad_arguments", spelled
        assert r.reward == pytest.approx(0.1 + 0.3 + 0.6 * 0.5)


def test_number_boolean_and_string_types_are_strict() -> None:
    number = {"type": "number"}
    assert values_match(0.5, 0.5, number) and values_match(2, 2.0, number)
    assert values_match(2.0, 2, number)  # a float parameter takes an integer, as in BFCL
    assert not values_match(0.5, "0.5", number)
    assert values_match(True, True, {"type": "boolean"})
    assert not values_match(True, "true", {"type": "boolean"})
    assert not values_match(True, 1, {"type": "boolean"})
    assert not values_match("5", 5, {"type": "string"})
    assert not values_match("true", True, {"type": "string"})
    assert not values_match(None, 0, {"type": "null"})


def test_free_text_folds_like_bfcl_constrained_strings_are_exact() -> None:
    assert fold_text("San Francisco, CA") == "sanfranciscoca"
    assert fold_text("It's") == 'it"s'
    text = {"type": "string"}
    assert values_match("April 1, 2024", "april 1 2024", text)
    assert values_match("Fix the   login\nbug", "fix the login bug", text)
    assert not values_match("Oslo", "Bergen", text)
    assert not values_match("T-1", "t1", {"type": "string", "pattern": "^T-[0-9]+$"})
    assert not values_match("2024-04-01", "20240401", {"type": "string", "format": "date"})
    assert values_match("high", "high", {"type": "string", "enum": ["low", "high"]})
    assert not values_match("high", "High", {"type": "string", "enum": ["low", "high"]})
    assert not values_match("high", "high ", {"type": "string", "enum": ["low", "high"]})


def test_arrays_objects_and_schema_combinators() -> None:
    ints = {"type": "array", "items": {"type": "integer"}}
    assert values_match([1, 2], [1, 2], ints)
    assert not values_match([1, 2], [1.0, 2], ints) and not values_match([1, 2], [2, 1], ints)
    assert values_match(["a", "b"], ["b", "a"], {"type": "array", "uniqueItems": True})
    pair = {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}
    assert values_match(["x", 1], ["X", 1], pair) and not values_match(["x", 1], ["x", "1"], pair)
    obj = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert values_match({"n": 3}, {"n": 3}, obj) and not values_match({"n": 3}, {"n": "3"}, obj)
    assert not values_match({"n": 3}, {"n": 3, "m": 1}, obj)
    either = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    assert values_match("dontcare", "DontCare", either) and values_match(3, 3, either)
    assert not values_match(3, "3", either)
    assert values_match(3, 3, {"type": ["integer", "null"]})
    assert not values_match(3, 3.0, {"type": ["integer", "null"]})
    assert values_match(5, 5.0) and not values_match(5, "5")  # untyped: JSON values


def test_key_order_never_matters() -> None:
    s = spec(ticket="T-1", priority=2, meta={"source": "mail", "count": 3})
    text = '{"arguments": {"meta": {"count": 3, "source": "mail"}, "priority": 2, ' \
           '"ticket": "T-1"}, "name": "set_priority"}'
    assert score(text, s).reward == 1.0


def test_arrays_are_ordered_unless_unique_items() -> None:
    s = spec(ticket="T-1", priority=2, labels=["a", "b"], watchers=["x", "y"])
    assert score(call(ticket="T-1", priority=2, labels=["a", "b"], watchers=["y", "x"]),
                 s).reward == 1.0
    assert score(call(ticket="T-1", priority=2, labels=["b", "a"], watchers=["x", "y"]),
                 s).failure_mode == "bad_arguments"


def test_default_and_admitted_null_count_as_absent() -> None:
    text = json.dumps({"name": "set_priority",
                       "arguments": json.dumps({"ticket": "T-1", "priority": 2,
                                                "notify": False})})
    assert score(text).reward == 1.0  # notify=False is the schema default: the same call
    nullable = [{"type": "function", "name": "set_priority", "parameters": {
        "type": "object", "required": ["ticket", "priority"], "properties": {
            "ticket": {"type": "string"}, "priority": {"type": "integer"},
            "level": {"type": ["string", "null"]}}}}]
    assert score(call(ticket="T-1", priority=2, level=None), tools=nullable).reward == 1.0
    # A null the schema does not admit is a wrong value (the old matcher called it absent);
    # a required argument is never absent, whatever its value.
    assert score(call(ticket="T-1", priority=2, level=None)).failure_mode == "bad_arguments"
    assert score(call(ticket="T-1", priority=None)).failure_mode == "bad_arguments"


def test_alternatives_and_optional_arguments() -> None:
    want = ExpectedCall(name="set_priority", arguments={"ticket": "T-1", "priority": 2,
                                                        "level": "high"},
                        alternatives={"priority": [3], "weight": [0.5]},
                        optional=["level", "weight", "priority"])
    schema = TOOLS[0]["parameters"]

    def share(**given: Any) -> float:
        return arguments_match(want.arguments, given, schema, alternatives=want.alternatives,
                               optional=want.optional)[0]

    assert share(ticket="T-1", priority=2, level="high") == 1.0
    assert share(ticket="T-1", priority=3) == 1.0  # alternative; level may be left out
    assert share(ticket="T-1", priority=3, weight=0.5) == 1.0  # optional, no canonical value
    assert share(ticket="T-1", priority=2, weight=0.7) == 0.75  # 3 of 4 counted
    # `priority` is in `optional`, but the schema requires it: leaving it out is missing.
    assert share(ticket="T-1", level="high") == pytest.approx(2 / 3)


def test_arguments_match_reports_each_mismatch() -> None:
    share, why = arguments_match({"a": 1, "b": "x"}, {"a": 2, "c": True})
    assert share == 0.0
    assert why == {"missing": ["b"], "extra": ["c"], "wrong": ["a"]}
    assert arguments_match({}, {}) == (1.0, {"missing": [], "extra": [], "wrong": []})


def test_missing_and_extra_arguments_get_partial_credit() -> None:
    missing = score(call(ticket="T-1"))
    assert missing.failure_mode == "bad_arguments"
    assert missing.reward_components["arguments"] == 0.5
    assert missing.reward == pytest.approx(0.1 + 0.3 + 0.6 * 0.5)
    assert missing.details["mismatches"] == [{"expected": 0, "call": 0, "tool": "set_priority",
                                              "missing": ["priority"]}]
    extra = score(call(ticket="T-1", priority=2, level="high"))
    assert extra.reward_components["arguments"] == pytest.approx(2 / 3)
    assert extra.details["mismatches"][0]["extra"] == ["level"]


def test_wrong_tool_and_hallucinated_tool() -> None:
    wrong = score(call("close_ticket", ticket="T-1"))
    assert (wrong.reward, wrong.failure_mode) == (0.1, "wrong_tool")
    made_up = score(call("escalate_ticket", ticket="T-1"))
    assert (made_up.reward, made_up.failure_mode) == (0.1, "hallucinated_tool")
    # Without the task's tools there is no list to hallucinate against.
    assert score(call("escalate_ticket"), tools=None).failure_mode == "wrong_tool"


def test_best_assignment_is_exact_not_greedy() -> None:
    # Greedy (row 0 takes column 0) would leave row 1 unpaired: 1.0; the best is 0.9 + 0.8.
    assert best_assignment([[1.0, 0.9], [0.8, None]]) == [(0, 1), (1, 0)]
    assert best_assignment([[None, None]]) == []
    assert best_assignment([[0.5], [0.7]]) == [(1, 0)]
    assert best_assignment([]) == []
    assert best_assignment([[1.0, 1.0]]) == [(0, 0)]  # ties: the earliest call
    assert best_assignment([[1.0], [1.0]]) == [(0, 0)]
    # 2 expected calls against 30 made stays exact: the search masks the smaller side.
    many = [[None] * 29 + [1.0], [0.4] + [None] * 28 + [0.9]]
    assert best_assignment(many) == [(0, 29), (1, 0)]


PARALLEL = ToolCallSpec(expected=[
    ExpectedCall(name="set_priority", arguments={"ticket": "T-1", "priority": 1}),
    ExpectedCall(name="set_priority", arguments={"ticket": "T-2", "priority": 2}),
    ExpectedCall(name="close_ticket", arguments={"ticket": "T-3"})])
T1, T2 = ("set_priority", {"ticket": "T-1", "priority": 1}), \
    ("set_priority", {"ticket": "T-2", "priority": 2})
T3 = ("close_ticket", {"ticket": "T-3"})


def test_parallel_calls_compare_as_a_multiset() -> None:
    env = ToolCallEnvironment()
    for order in ((T1, T2, T3), (T3, T2, T1), (T2, T3, T1)):
        assert env.verify(PARALLEL, message(*order), tools=TOOLS).reward == 1.0
    # Two right, one with a wrong priority: right_tool 3/3, arguments (1 + 1 + 1/2) / 3.
    half = env.verify(PARALLEL, message(T1, ("set_priority", {"ticket": "T-2", "priority": 9}),
                                        T3), tools=TOOLS)
    assert half.failure_mode == "bad_arguments"
    assert half.reward_components["arguments"] == pytest.approx(2.5 / 3)
    assert half.reward == pytest.approx(0.1 + 0.3 + 0.6 * 2.5 / 3)
    assert half.details["mismatches"] == [{"expected": 1, "call": 1, "tool": "set_priority",
                                           "wrong": ["priority"]}]


def test_missing_and_extra_calls_count_against() -> None:
    env = ToolCallEnvironment()
    short = env.verify(PARALLEL, message(T1, T3), tools=TOOLS)
    assert short.failure_mode == "incomplete"
    assert short.reward_components == {"valid_json": 1.0, "right_tool": 2 / 3,
                                       "arguments": 2 / 3, "unsafe": 0.0}
    assert short.reward == pytest.approx(0.1 + 0.9 * 2 / 3)
    assert short.details["missing_calls"] == ["set_priority"]
    extra = env.verify(PARALLEL, message(T1, T2, T3, T3), tools=TOOLS)
    assert extra.failure_mode == "wrong_tool"
    assert extra.reward == pytest.approx(0.1 + 0.9 * 3 / 4)
    assert extra.details["extra_calls"] == ["close_ticket"]


def test_unsafe_call_scores_zero_whatever_else() -> None:
    r = score(call("delete_all"))
    assert (r.reward, r.failure_mode) == (0.0, "unsafe_action")
    assert r.reward_components["unsafe"] == 1.0
    listed = ToolCallSpec(expected=[ExpectedCall(name="set_priority", arguments={})],
                          unsafe_tools=["close_ticket"])
    assert score(call("close_ticket"), listed).failure_mode == "unsafe_action"
    among_right_ones = ToolCallEnvironment().verify(PARALLEL, message(T1, T2, T3,
                                                                      ("delete_all", {})),
                                                    tools=TOOLS)
    assert (among_right_ones.reward, among_right_ones.failure_mode) == (0.0, "unsafe_action")


def test_task_expecting_an_unsafe_call_is_a_task_bug() -> None:
    bad = ToolCallSpec(expected=[ExpectedCall(name="delete_all")])
    with pytest.raises(ValueError, match="marked unsafe"):
        score(call("delete_all"), bad)


def test_assistant_message_is_the_main_path() -> None:
    env, s = ToolCallEnvironment(), spec(ticket="T-1", priority=2)
    as_string = message(("set_priority", '{"ticket": "T-1", "priority": 2}'))
    as_object = message(("set_priority", {"ticket": "T-1", "priority": 2}), content="On it.")
    assert env.verify(s, as_string, tools=TOOLS).reward == 1.0
    assert env.verify(s, as_object, tools=TOOLS).reward == 1.0
    assert env.verify(s, as_object["tool_calls"], tools=TOOLS).reward == 1.0  # a call list
    parsed = {"name": "set_priority", "arguments": '{"ticket": "T-1", "priority": 2}'}
    assert env.verify(s, parsed, tools=TOOLS).reward == 1.0  # one call dict


@pytest.mark.parametrize(("output", "why"), [
    (message(content="I set it."), "no tool call"),
    ({"role": "assistant", "content": "<tool_call>{", "tool_calls": [],
      "parse_error": "unterminated JSON"}, "unterminated JSON"),
    (message(("set_priority", "{oops")), "not JSON"),
    (message(("set_priority", "[1]")), "JSON object"),
    (message(("", {})), "name"),
    ([], "no tool call"),
    ({"role": "user", "content": "hi"}, "assistant"),
])
def test_malformed_messages_are_invalid_format(output: Any, why: str) -> None:
    r = ToolCallEnvironment().verify(spec(ticket="T-1", priority=2), output, tools=TOOLS)
    assert (r.reward, r.failure_mode) == (0.0, "invalid_format")
    assert r.reward_components["valid_json"] == 0.0
    assert why in r.details["error"]


def test_verify_calls_is_the_pure_core() -> None:
    s = spec(ticket="T-1", priority=2)
    assert verify_calls(s, [Call("set_priority", {"ticket": "T-1", "priority": 2})]).reward == 1.0
    assert verify_calls(s, []).failure_mode == "invalid_format"


@pytest.mark.parametrize("text", ['{"tool": "set_priority", "arguments": {',
                                  'Sure! {"tool": "set_priority", "arguments": {}}',
                                  '["set_priority"]', '{"arguments": {}}',
                                  '{"tool": "set_priority", "arguments": [1]}',
                                  '{"tool": "set_priority", "arguments": "{oops"}'])
def test_invalid_text_scores_zero(text: str) -> None:
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


@pytest.mark.parametrize("output", ["", "   \n", None, message(), {"role": "assistant"}])
def test_empty_output_is_an_abstention_scored_zero(output: Any) -> None:
    # Answering nothing must never beat a wrong answer: it is scored, reward 0, `empty`.
    got = ToolCallEnvironment().verify(spec(ticket="T-1", priority=2), output, tools=TOOLS)
    assert got.reward == 0.0 and got.failure_mode == "empty"
    assert set(got.reward_components.values()) == {0.0}


def test_old_stored_task_json_still_loads() -> None:
    old = ('{"kind": "tool_call", "expected": {"name": "get_weather", "arguments": '
           '{"city": "Oslo"}}, "unsafe_tools": ["delete_all_tickets"]}')
    s = ToolCallSpec.model_validate_json(old)
    assert s.expected == [ExpectedCall(name="get_weather", arguments={"city": "Oslo"})]
    assert s.unsafe_tools == ["delete_all_tickets"]
    assert ToolCallSpec.model_validate_json(s.model_dump_json()) == s
    with pytest.raises(ValueError, match="at least 1"):
        ToolCallSpec(expected=[])
    with pytest.raises(ValueError, match="canonical value"):
        ExpectedCall(name="f", alternatives={"city": ["Oslo"]})
    with pytest.raises(ValueError, match="extra"):
        ExpectedCall.model_validate({"name": "f", "accept": {}})
