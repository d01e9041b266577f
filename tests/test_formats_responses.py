"""Responses API logs through the decoding boundary: one `response` object, a
request/response pair and a `previous_response_id` chain become one v1 trajectory each."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from flywheel.formats import ParseContext
from flywheel.ingest.wire import validate_record
from flywheel.mining.build import Unverifiable, build_task
from flywheel.mining.classify import classify_failure
from flywheel.mining.expected import expected_calls
from flywheel.tasks import ToolCallSpec
from flywheel.trajectory import Trajectory, parse_trajectory

TOOLS = [{"type": "function", "name": n, "description": f"{n} of an order", "strict": True,
          "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                         "required": ["order_id"], "additionalProperties": False}}
         for n in ("get_order", "refund", "cancel_order")]
INSTRUCTIONS = "You are the shop's order assistant."


def response(n: int, output: list[dict[str, Any]], *, previous: str | None = None,
             **extra: Any) -> dict[str, Any]:
    """A `response` object as the API returns it (the fields openai-python's `Response`
    requires, and the usual optional ones)."""
    return {"id": f"resp_{n}", "object": "response", "created_at": 1746138417 + n,
            "completed_at": 1746138418 + n, "status": "completed", "error": None,
            "incomplete_details": None, "instructions": INSTRUCTIONS, "metadata": {},
            "model": "gpt-4.1-mini-2025-04-14", "output": output, "parallel_tool_calls": True,
            "temperature": 1.0, "tool_choice": "auto", "tools": TOOLS, "top_p": 1.0,
            "previous_response_id": previous, "store": True, "text": {"format": {"type":
                                                                                 "text"}},
            "usage": {"input_tokens": 80 + n, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": 10, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": 90 + n}, **extra}


def call(n: int, name: str, order: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": name,
            "arguments": json.dumps({"order_id": order}), "status": "completed"}


def text(n: int, words: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": words, "annotations": []}]}


def chain() -> list[dict[str, Any]]:
    """An agent's three calls: look the order up, then (wrongly) cancel it, then say so."""
    return [
        {**response(1, [call(1, "get_order", "7101")]),
         "input": [{"role": "user", "content": "Please refund order 7101, it arrived broken."}]},
        {**response(2, [call(2, "cancel_order", "7101")], previous="resp_1"),
         "input": [{"type": "function_call_output", "call_id": "call_1",
                    "output": '{"status": "delivered"}'}]},
        {**response(3, [text(3, "Order 7101 is cancelled.")], previous="resp_2"),
         "input": [{"type": "function_call_output", "call_id": "call_2",
                    "output": [{"type": "input_text", "text": '{"cancelled": true}'}],
                    "status": "completed"}]}]


def kinds(t: Trajectory) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for item in t.items:
        d = item.model_dump()
        if d["type"] == "message":
            out.append(("message", d["role"], d["content"]))
        elif d["type"] == "function_call":
            out.append(("call", d["call_id"], d["name"], d["arguments"]))
        else:
            out.append(("output", d["call_id"], d["output"], d["status"]))
    return out


def test_a_chain_is_stitched_into_one_trajectory_whatever_the_listed_order() -> None:
    calls = chain()
    shuffled = random.Random(3).sample(calls, 3)
    assert shuffled != calls
    t = parse_trajectory({"responses": shuffled, "agent": "shop-bot"})
    assert kinds(t) == [
        ("message", "system", INSTRUCTIONS),
        ("message", "user", "Please refund order 7101, it arrived broken."),
        ("call", "call_1", "get_order", '{"order_id": "7101"}'),
        ("output", "call_1", '{"status": "delivered"}', "ok"),
        ("call", "call_2", "cancel_order", '{"order_id": "7101"}'),
        ("output", "call_2", '{"cancelled": true}', "ok"),
        ("message", "assistant", "Order 7101 is cancelled.")]
    assert [tool.name for tool in t.tools] == ["get_order", "refund", "cancel_order"]
    assert t.model == "gpt-4.1-mini-2025-04-14" and t.session_id == "resp_1"
    assert t.usage is not None and (t.usage.input_tokens, t.usage.output_tokens) == (246, 30)
    assert t.started_at is not None and int(t.started_at.timestamp()) == 1746138418
    assert t.ended_at is not None and int(t.ended_at.timestamp()) == 1746138421
    assert t.outcome is None and t.status == "awaiting_outcome"
    meta = t.metadata
    assert meta["source_format"] == "responses" and meta["request_id"] == "resp_3"
    assert meta["response_ids"] == ["resp_1", "resp_2", "resp_3"]
    assert meta["responses"][1]["previous_response_id"] == "resp_1"
    assert meta["responses"][0]["temperature"] == 1.0  # nothing of a response is dropped
    # The content-derived id is of the record as sent: listed in another order, the same
    # chain is another record (send `trajectory_id` to make re-sends idempotent anyway).
    listed = parse_trajectory({"responses": calls, "agent": "shop-bot"})
    assert listed.items == t.items and listed.trajectory_id != t.trajectory_id


def test_a_corrected_chain_mines_into_a_task_on_the_failing_call() -> None:
    """The whole chain is judged (as a v1 trajectory is): its first wrong call fails."""
    first, _, last = chain()
    wrong = [{**first, "output": [call(1, "cancel_order", "7101")]},
             {**last, "previous_response_id": "resp_1", "input": [
                 {"type": "function_call_output", "call_id": "call_1", "output": "done"}]}]
    t = parse_trajectory({"responses": wrong, "agent": "shop-bot", "outcome": {
        "status": "failure", "human_intervention": {"corrected_items": [
            {"type": "function_call", "call_id": "fix", "name": "refund",
             "arguments": '{"order_id": "7101"}'}]}}})
    found = expected_calls(t)
    assert found is not None
    task = build_task(t, classify_failure(t, found[0]))
    assert not isinstance(task, Unverifiable), task
    assert isinstance(task.verifier, ToolCallSpec)
    assert [(c.name, c.arguments) for c in task.verifier.expected] == \
        [("refund", {"order_id": "7101"})]
    assert task.failure_mode == "wrong_tool"
    assert task.messages == [{"role": "system", "content": INSTRUCTIONS},
                             {"role": "user", "content": chain()[0]["input"][0]["content"]}]


def test_one_response_object_with_its_input() -> None:
    record = {**response(1, [call(1, "get_order", "7101")], metadata={"session_id": "s-9"}),
              "input": "Where is order 7101?", "agent": "bot", "latency_ms": 812.0}
    t = parse_trajectory(record)
    assert kinds(t)[1:] == [("message", "user", "Where is order 7101?"),
                            ("call", "call_1", "get_order", '{"order_id": "7101"}')]
    assert t.session_id == "s-9" and t.latency_ms == 812.0 and t.agent == "bot"
    assert t.metadata["responses"][0]["metadata"] == {"session_id": "s-9"}
    assert "unknown_fields" not in t.metadata  # the response's fields are not "unknown"


def test_a_request_response_pair() -> None:
    resp = response(5, [text(5, "Hello!")], instructions=None)
    record = {"request": {"model": "gpt-4.1-mini", "instructions": "Be brief.",
                          "input": [{"type": "message", "role": "user",
                                     "content": [{"type": "input_text", "text": "Hi"}]}],
                          "temperature": 0.2},
              "response": resp, "outcome": {"status": "success"}}
    t = validate_record(record, context=ParseContext(token_agent="gw-bot"))
    assert isinstance(t, Trajectory), t
    assert kinds(t) == [("message", "system", "Be brief."), ("message", "user", "Hi"),
                        ("message", "assistant", "Hello!")]
    assert t.agent == "gw-bot" and t.is_success
    assert t.metadata["responses"][0]["temperature"] == 1.0  # the response's, the request's
    assert t.metadata["request_id"] == "resp_5"


def test_what_v1_has_no_item_for_is_kept_and_a_failed_response_is_an_error() -> None:
    search = {"type": "web_search_call", "id": "ws_1", "status": "completed",
              "action": {"type": "search", "query": "order 7101"}}
    web = {"type": "web_search"}
    record = response(1, [search, text(1, "Found nothing.")], tools=[*TOOLS, web],
                      status="failed", error={"code": "server_error", "message": "boom"})
    t = parse_trajectory({**record, "input": "look it up"})
    assert t.metadata["other_items"] == [{"index": 2, "item": search}]
    assert t.metadata["other_tools"] == [web] and len(t.tools) == 3
    assert t.outcome is not None and (t.outcome.status, t.outcome.error) == ("error", "boom")


@pytest.mark.parametrize(("responses", "error"), [
    ([], "responses must list at least one response"),
    ([{"id": "x"}], "responses[0] must be a Responses API `response` object"),
    ([response(1, []), response(1, [])], "responses[0] and responses[1] are both 'resp_1'"),
    ([response(1, []), response(2, [], previous="resp_1"),
      response(3, [], previous="resp_1")], "responses[1] and responses[2] both continue "
     "'resp_1'"),
])
def test_malformed_chains_are_refused_saying_why(responses: list[Any], error: str) -> None:
    got = validate_record({"responses": responses})
    assert isinstance(got, tuple) and got[0] == "schema", got
    assert error in got[1], got[1]


def test_a_function_call_output_that_did_not_complete_is_an_error_result() -> None:
    record = {**response(2, [text(2, "Sorry.")], previous="resp_1"), "input": [
        {"type": "function_call_output", "call_id": "c", "output": "timeout",
         "status": "incomplete"}]}
    t = parse_trajectory(record)
    assert kinds(t)[1] == ("output", "c", "timeout", "error")
