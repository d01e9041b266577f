"""Responses API logs on the real stack (broker, Postgres, ingest, miner, relay and API as
spawned processes; the stack of tests/test_formats_e2e.py): a `previous_response_id` chain
and a single `response` object, through the HTTP gateway and through a librdkafka client.
Both are stored awaiting their outcome; a thumbs-down with a correction, naming the chain by
its last response's id, turns the chain into a failure and a task."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from flywheel.trajectory import parse_trajectory
from tests.support.helpers import scalar, wait_for
from tests.test_formats_e2e import TOKEN, Stack, _counts, _fetchval, stack  # noqa: F401

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]
TOOLS = [{"type": "function", "name": n, "description": f"{n} of an order", "strict": True,
          "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                         "required": ["order_id"], "additionalProperties": False}}
         for n in ("get_order", "cancel_order", "refund")]
INSTRUCTIONS = "You are the shop's order assistant."


def _response(rid: str, output: list[dict[str, Any]], previous: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": 1764620000, "status": "completed",
            "error": None, "incomplete_details": None, "instructions": INSTRUCTIONS,
            "metadata": {}, "model": "gpt-4.1-mini", "output": output,
            "parallel_tool_calls": True, "temperature": 1.0, "tool_choice": "auto",
            "tools": TOOLS, "top_p": 1.0, "previous_response_id": previous,
            "usage": {"input_tokens": 90, "output_tokens": 12, "total_tokens": 102}}


def records(path: str, order: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(a chain that cancels where the user asked for a refund, a lone lookup)."""
    wrong = {"type": "function_call", "id": f"fc_{path}_1", "call_id": f"call_{path}_1",
             "name": "cancel_order", "arguments": json.dumps({"order_id": order}),
             "status": "completed"}
    chain = {"responses": [
        {**_response(f"resp_{path}_1", [wrong], None),
         "input": [{"role": "user", "content": f"Please refund order {order}, it arrived "
                                               "broken."}]},
        {**_response(f"resp_{path}_2", [{"type": "message", "id": f"msg_{path}_2",
                                         "role": "assistant", "status": "completed",
                                         "content": [{"type": "output_text", "annotations": [],
                                                      "text": f"Order {order} is cancelled."}]}],
                     f"resp_{path}_1"),
         "input": [{"type": "function_call_output", "call_id": f"call_{path}_1",
                    "output": '{"cancelled": true}'}]}]}
    lookup = {**_response(f"resp_{path}_9", [{
        "type": "function_call", "id": f"fc_{path}_9", "call_id": f"call_{path}_9",
        "name": "get_order", "arguments": json.dumps({"order_id": order}),
        "status": "completed"}], None), "input": f"Where is order {order}?"}
    return chain, lookup


def thumbs_down(order: str) -> dict[str, Any]:
    return {"rating": "down", "by": "support-lead", "note": "cancelled instead of refunding",
            "correction": [{"type": "function_call", "call_id": "fix", "name": "refund",
                            "arguments": json.dumps({"order_id": order})}]}


async def _stored_then_corrected(on: Stack, chain: dict[str, Any], lookup: dict[str, Any],
                                 order: str, before: dict[str, int]) -> None:
    ids = [str(parse_trajectory(r).trajectory_id) for r in (chain, lookup)]
    in_ids = "'" + "','".join(ids) + "'"
    assert await wait_for(on.dsn, f"SELECT count(*) FROM trajectories WHERE trajectory_id "
                                     f"IN ({in_ids})", 2) == 2
    task_sql = (f"SELECT count(*) FROM task_sources s JOIN tasks t USING (task_id) "
                f"WHERE s.trajectory_id = '{ids[0]}' AND t.expected_from = 'human_correction'")
    assert await wait_for(on.dsn, task_sql, 1, 60) == 1, "the correction made no task"
    assert await scalar(on.dsn, f"SELECT count(*) FROM failures WHERE trajectory_id = "
                                   f"'{ids[0]}' AND failure_mode = 'wrong_tool'") == 1
    spec = json.loads(str(await _fetchval(on.dsn, f"""SELECT t.spec::text FROM tasks t
        JOIN task_sources s USING (task_id) WHERE s.trajectory_id = '{ids[0]}'""")))
    assert spec["verifier"]["expected"] == [{"name": "refund", "arguments": {
        "order_id": order}, "alternatives": {}, "optional": []}]
    assert spec["messages"] == [{"role": "system", "content": INSTRUCTIONS}, {
        "role": "user", "content": f"Please refund order {order}, it arrived broken."}]
    assert await scalar(on.dsn, f"SELECT count(*) FROM trajectories WHERE trajectory_id "
                                   f"= '{ids[1]}' AND status = 'awaiting_outcome'") == 1
    await wait_for(on.dsn, "SELECT count(*) FROM outbox WHERE published_at IS NULL", 0)
    after = await _counts(on)
    assert {k: after[k] - before[k] for k in after} == {
        "trajectories": 2, "awaiting_outcome": 1, "failures": 1, "tasks": 1,
        "feedback_applied": 1}


async def test_responses_logs_through_the_gateway(stack: Stack) -> None:  # noqa: F811
    order = "8101"
    chain, lookup = records("gw", order)
    before = await _counts(stack)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=stack.api, headers=headers, timeout=30) as client:
        r = await client.post("/v1/trajectories", json=[chain, lookup])
        assert r.status_code == 202, r.text
        r = await client.post("/v1/trajectories/resp_gw_2/feedback", json=thumbs_down(order))
        assert r.status_code == 202, r.text
    await _stored_then_corrected(stack, chain, lookup, order, before)


async def test_responses_logs_through_kafka(stack: Stack) -> None:  # noqa: F811
    from confluent_kafka import Producer

    order = "8202"
    chain, lookup = records("kafka", order)
    before = await _counts(stack)
    producer = Producer({"bootstrap.servers": stack.settings.kafka.bootstrap, "acks": "all"})
    topics = stack.settings.topics
    for record in (chain, lookup):
        producer.produce(topics.trajectories, key=str(uuid.uuid4()).encode(),
                         value=json.dumps(record).encode(),
                         headers=[("flywheel-agent", b"agents-sdk-bot")])
    producer.produce(topics.feedback, key=b"resp_kafka_2",
                     value=json.dumps({**thumbs_down(order),
                                       "request_id": "resp_kafka_2"}).encode())
    assert producer.flush(30) == 0
    await _stored_then_corrected(stack, chain, lookup, order, before)
    assert await scalar(stack.dsn, "SELECT count(*) FROM trajectories WHERE agent = "
                                   "'agents-sdk-bot'") == 2
    assert await scalar(stack.dsn, "SELECT count(*) FROM dead_letters") == 0
