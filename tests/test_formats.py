"""What agents already log, as they log it: pairs → items, agent derivation, feedback (pure)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from pydantic import ValidationError

from flywheel.feedback import parse_feedback
from flywheel.formats import ParseContext, conversation_id, derive_agent, header_agent
from flywheel.ingest.wire import RawRecord, classify
from flywheel.mining.build import build_task
from flywheel.mining.classify import classify_failure, decision_start
from flywheel.mining.expected import expected_calls, same_episode
from flywheel.mining.feedback_apply import apply_all, apply_feedback
from flywheel.tasks import ToolCallSpec
from flywheel.trajectory import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    parse_trajectory,
)

TOOLS = [{"type": "function", "function": {
    "name": name, "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                                 "required": ["order_id"]}}}
    for name in ("get_order", "cancel_order", "refund")]
SYSTEM = {"role": "system", "content": "You are the shop's order assistant."}
USER = {"role": "user", "content": "Please refund order 7"}


def call(name: str, args: Any, call_id: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if call_id is not None:
        out["id"] = call_id
    return out


def pair(messages: list[dict[str, Any]], answer: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A record as the Data Flywheel blueprint documents it (docs/FORMATS.md)."""
    return {"timestamp": 1746138417, "client_id": "shop-prod", "workload_id": "orders",
            "request": {"model": "m", "messages": messages, "tools": TOOLS, "temperature": 0.2},
            "response": {"id": "chatcmpl-9", "object": "chat.completion", "created": 1746138417,
                         "model": "m-2025", "choices": [{"index": 0, "message": answer,
                                                         "finish_reason": "tool_calls"}],
                         "usage": {"prompt_tokens": 100, "completion_tokens": 12,
                                   "total_tokens": 112}},
            **extra}


FIRST = pair([SYSTEM, USER], {"role": "assistant", "content": None,
                              "tool_calls": [call("get_order", {"order_id": "7"})]})
HISTORY = [SYSTEM, USER,
           {"role": "assistant", "content": None,
            "tool_calls": [call("get_order", {"order_id": "7"})]},
           {"role": "tool", "tool_call_id": "call_2_0", "content": '{"status": "delivered"}'}]
SECOND = pair(HISTORY, {"role": "assistant", "content": None,
                        "tool_calls": [call("cancel_order", '{"order_id": "7"}', "call_x")]})


def test_a_pair_becomes_its_request_transcript_plus_the_answer() -> None:
    t = parse_trajectory(FIRST)
    assert [type(i) for i in t.items] == [MessageItem, MessageItem, FunctionCallItem]
    answer = t.items[-1]
    assert isinstance(answer, FunctionCallItem)
    # No tool-call id in the log: numbered as the next request of the conversation will.
    assert (answer.call_id, answer.name, json.loads(answer.arguments)) == \
        ("call_2_0", "get_order", {"order_id": "7"})
    assert t.model == "m-2025" and [tool.name for tool in t.tools] == \
        ["get_order", "cancel_order", "refund"]
    assert t.usage is not None and (t.usage.input_tokens, t.usage.output_tokens) == (100, 12)
    assert t.started_at is not None and int(t.started_at.timestamp()) == 1746138417
    assert t.outcome is None and t.status == "awaiting_outcome" and not t.is_failure
    m = t.metadata
    assert (m["source_format"], m["request_id"], m["client_id"], m["workload_id"],
            m["response_index"]) == ("request_response", "chatcmpl-9", "shop-prod", "orders", 2)
    assert m["request"] == {"model": "m", "temperature": 0.2}  # nothing dropped
    assert m["response"]["choice"] == {"index": 0, "finish_reason": "tool_calls"}
    assert (t.agent, m["agent_source"]) == ("unknown", "default")
    assert decision_start(t) == 2


def test_calls_of_one_conversation_are_linked_not_workload_alone() -> None:
    a, b = parse_trajectory(FIRST), parse_trajectory(SECOND)
    assert a.session_id == b.session_id == conversation_id("shop-prod", "orders", [SYSTEM, USER])
    assert a.metadata["session_source"] == "conversation"
    # The second call's request holds the first's answer with the same call id.
    first_call = next(i for i in b.items if isinstance(i, FunctionCallItem))
    assert first_call.call_id == a.items[-1].call_id  # type: ignore[union-attr]
    assert same_episode(a, b) and same_episode(b, a)
    other_user = pair([SYSTEM, {"role": "user", "content": "where is order 8?"}],
                      FIRST["response"]["choices"][0]["message"])
    assert parse_trajectory(other_user).session_id != a.session_id  # same workload_id
    explicit = parse_trajectory({**FIRST, "session_id": "s-1"})
    assert (explicit.session_id, explicit.metadata["session_source"]) == ("s-1", "record")
    stored = dict(FIRST, request={**FIRST["request"], "metadata": {"session_id": "s-2"}})
    assert parse_trajectory(stored).session_id == "s-2"


@pytest.mark.parametrize(("change", "error"), [
    ({"request": {"messages": []}}, "request.messages must be a non-empty list"),
    ({"request": "POST /v1/chat"}, "'request' must be an object"),
    ({"response": {"choices": []}}, "response.choices must be a non-empty list"),
    ({"response": {"choices": [{"text": "hi"}]}}, "choices[0] must be an object with a 'message'"),
])
def test_a_broken_pair_says_what_is_missing(change: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        parse_trajectory({**FIRST, **change})


def test_the_agent_comes_from_record_header_token_publisher_then_default() -> None:
    full = ParseContext(header_agent="h", token_agent="k", publisher_agent="p")
    assert derive_agent("bot", full) == ("bot", "record")
    assert derive_agent(None, full) == ("h", "header")
    assert derive_agent(None, ParseContext(token_agent="k", publisher_agent="p")) == \
        ("k", "token")
    assert derive_agent(None, ParseContext(publisher_agent="p")) == ("p", "publisher")
    assert derive_agent(None, None) == ("unknown", "default")
    assert derive_agent("", full) == ("", "record")  # refused by validation, not replaced


def test_a_transcript_with_no_field_of_ours_is_accepted_and_awaits_its_outcome() -> None:
    record = {"model": "gpt-4o", "tools": TOOLS,
              "messages": [*HISTORY, {"role": "assistant", "content": "Refunded."}]}
    bare = parse_trajectory(record)
    named = parse_trajectory(record, ParseContext(header_agent="support-bot"))
    assert (bare.agent, named.agent) == ("unknown", "support-bot")
    assert named.metadata["agent_source"] == "header" and named.status == "awaiting_outcome"
    assert bare.trajectory_id == named.trajectory_id  # where the agent came from: same record
    owned = parse_trajectory({**record, "agent": "mine"}, ParseContext(header_agent="x"))
    assert owned.agent == "mine" and "agent_source" not in owned.metadata
    with pytest.raises(ValidationError, match="needs what the agent did"):
        parse_trajectory({"model": "gpt-4o"})


def test_the_kafka_header_names_the_agent_in_ingest() -> None:
    value = json.dumps({"messages": [USER, {"role": "assistant", "content": "ok"}]}).encode()
    records = [RawRecord("t", 0, 0, None, value, (("flywheel-agent", b"ops-bot"),)),
               RawRecord("t", 0, 1, None, value, (("flywheel-agent", b"\xff\xfe"),)),
               RawRecord("t", 0, 2, None, value)]
    accepted, rejected = classify(records, max_bytes=1 << 20)
    assert not rejected
    assert [a.row.agent for a in accepted] == ["ops-bot", "unknown", "unknown"]
    assert [a.row.status for a in accepted] == ["awaiting_outcome"] * 3
    assert header_agent([("other", b"x"), ("flywheel-agent", b"  ")]) is None


def test_structured_feedback_may_be_an_object_or_a_json_string() -> None:
    want = {"expected_call": {"name": "refund", "arguments": {"order_id": "7"}}}
    base = {"agent": "a", "items": [{"type": "message", "role": "user", "content": "hi"}]}
    for feedback in (want, json.dumps(want)):
        t = parse_trajectory({**base, "outcome": {"status": "failure", "feedback": feedback}})
        found = expected_calls(t)
        assert found is not None and [c.name for c in found[0]] == ["refund"]


def test_feedback_is_validated_and_gets_a_stable_id() -> None:
    fb = parse_feedback({"rating": -1, "note": "wrong order"}, request_id="chatcmpl-9")
    assert (fb.rating, fb.request_id, fb.target) == ("down", "chatcmpl-9", "chatcmpl-9")
    assert parse_feedback({"rating": "thumbs_up", "request_id": "r"}).rating == "up"
    again = parse_feedback({"rating": -1, "note": "wrong order"}, request_id="chatcmpl-9")
    assert again.feedback_id == fb.feedback_id
    correction = parse_feedback({"trajectory_id": str(uuid.uuid4()), "correction": {
        "role": "assistant", "tool_calls": [call("refund", {"order_id": "7"})]}})
    assert correction.correction is not None
    assert [type(i) for i in correction.correction] == [FunctionCallItem]
    with pytest.raises(ValidationError, match="names no trajectory"):
        parse_feedback({"rating": "down"})
    with pytest.raises(ValidationError, match="says nothing"):
        parse_feedback({"request_id": "r"})
    with pytest.raises(ValueError, match="the URL names"):
        parse_feedback({"request_id": "a", "rating": "up"}, request_id="b")
    extra = parse_feedback({"request_id": "r", "rating": "up", "ticket": 42})
    assert extra.metadata["unknown_fields"] == {"ticket": 42}


def test_feedback_sets_the_outcome_later_ones_win() -> None:
    t = parse_trajectory(FIRST)
    fid = {"request_id": "chatcmpl-9"}
    down = apply_feedback(t, parse_feedback({**fid, "rating": "down"}))
    assert (down.status, down.is_failure) == ("failure", True)
    assert down.outcome is not None and down.outcome.model_extra == {"rating": "down"}
    assert apply_feedback(t, parse_feedback({**fid, "note": "hm"})).status == "awaiting_outcome"
    up_after = apply_all(t, [parse_feedback({**fid, "rating": "down"}),
                             parse_feedback({**fid, "rating": "up", "by": "lead"})])
    assert up_after.status == "success"
    assert [f.get("rating") for f in up_after.metadata["feedback"]] == ["down", "up"]
    explicit = apply_feedback(t, parse_feedback({**fid, "rating": "up", "outcome": {
        "status": "escalated", "error": "handed to a human"}}))
    assert explicit.outcome is not None and \
        (explicit.status, explicit.outcome.error) == ("escalated", "handed to a human")


def test_a_thumbs_down_with_a_correction_of_a_pairs_answer_becomes_its_task() -> None:
    t = parse_trajectory(SECOND)
    fb = parse_feedback({"rating": "down", "by": "agent-lead", "correction": [
        {"role": "assistant", "tool_calls": [call("refund", '{"order_id": "7"}')]}]},
        request_id="chatcmpl-9")
    failed = apply_feedback(t, fb)
    found = expected_calls(failed)
    assert found is not None and found[1] == "human_correction"
    c = classify_failure(failed, found[0])
    # The request's own call (get_order) is context; the answer is what was corrected.
    assert (c.mode, c.step, c.evidence["expected_tool"]) == ("wrong_tool", 4, "refund")
    task = build_task(failed, c)
    assert not hasattr(task, "reason"), task
    assert isinstance(task.verifier, ToolCallSpec)
    assert [(e.name, e.arguments) for e in task.verifier.expected] == [("refund",
                                                                       {"order_id": "7"})]
    assert [m["role"] for m in task.messages] == ["system", "user", "assistant", "tool"]


def test_structured_feedback_for_a_pair_is_about_its_answer() -> None:
    t = parse_trajectory(SECOND)
    fb = parse_feedback({"request_id": "chatcmpl-9", "feedback": {
        "expected_call": {"name": "refund", "arguments": {"order_id": "7"}}}})
    failed = apply_feedback(t, fb)
    assert failed.status == "failure"  # expected calls say the agent should have done otherwise
    found = expected_calls(failed)
    assert found is not None and [c.name for c in found[0]] == ["get_order", "refund"]
    task = build_task(failed, classify_failure(failed, found[0]))
    assert isinstance(task.verifier, ToolCallSpec)  # not Unverifiable
    assert [e.name for e in task.verifier.expected] == ["refund"]


def test_a_later_call_of_the_same_conversation_is_no_retry() -> None:
    failed = apply_feedback(parse_trajectory(FIRST),
                            parse_feedback({"request_id": "x", "rating": "down"}))
    later = apply_feedback(parse_trajectory(SECOND),
                           parse_feedback({"request_id": "x", "rating": "up"}))
    assert same_episode(failed, later) and expected_calls(failed, later) is None
    # A new attempt at the same opening that did something else is a retry.
    retry = apply_feedback(parse_trajectory(pair([SYSTEM, USER], {
        "role": "assistant", "tool_calls": [call("refund", {"order_id": "7"})]})),
        parse_feedback({"request_id": "y", "rating": "up"}))
    assert not same_episode(failed, retry)
    found = expected_calls(failed, retry)
    assert found is not None and found[1] == f"retry:{retry.trajectory_id}"
    # A record without an action continues nothing.
    opening = parse_trajectory({"agent": "a", "outcome": {"status": "escalated"},
                                "items": [{"type": "message", **USER}]})
    assert not same_episode(opening, retry)


def test_tool_results_of_a_pair_keep_their_status_and_order() -> None:
    t = parse_trajectory(SECOND)
    outputs = [i for i in t.items if isinstance(i, FunctionCallOutputItem)]
    assert [(o.call_id, o.status) for o in outputs] == [("call_2_0", "ok")]
