"""Wire format v1: round-trips, chat-format conversion, unknown fields, derived ids."""

from __future__ import annotations

import json
import random
import uuid

import pytest
from pydantic import ValidationError

from flywheel.demo.samples import make_trajectory
from flywheel.events import DeadLettered, DeadLetterPayload, parse_event
from flywheel.ingest.wire import decode
from flywheel.trajectory import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    Trajectory,
    parse_trajectory,
)


def test_v1_round_trip_is_lossless() -> None:
    record = make_trajectory(random.Random(3))
    t = parse_trajectory(record)
    again = Trajectory.model_validate_json(t.model_dump_json())
    assert again == t
    assert again.trajectory_id == uuid.UUID(record["trajectory_id"])
    assert [i.type for i in again.items] == [
        "message", "message", "function_call", "function_call_output", "message"]


def test_chat_transcript_converts_to_items_in_order() -> None:
    chat = {
        "agent": "a", "outcome": {"status": "failure"},
        "tools": [{"type": "function", "function": {"name": "get_weather",
                                                    "parameters": {"type": "object"}}}],
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
                {"id": "c2", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Bergen"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3C"},
            {"role": "tool", "tool_call_id": "c2", "content": {"temp": 5}},
        ],
    }
    t = parse_trajectory(chat)
    assert t.tools[0].name == "get_weather"
    kinds = [type(i) for i in t.items]
    assert kinds == [MessageItem, MessageItem, MessageItem, FunctionCallItem, FunctionCallItem,
                     FunctionCallOutputItem, FunctionCallOutputItem]
    calls = [i for i in t.items if isinstance(i, FunctionCallItem)]
    assert calls[0].arguments == '{"city": "Oslo"}'
    assert json.loads(calls[1].arguments) == {"city": "Bergen"}  # objects become JSON strings
    outputs = [i for i in t.items if isinstance(i, FunctionCallOutputItem)]
    assert [o.call_id for o in outputs] == ["c1", "c2"]
    assert t.metadata["source_format"] == "chat_completions"


def test_missing_id_is_derived_from_content_deterministically() -> None:
    rec = make_trajectory(random.Random(5), chat_format=True, with_id=False)
    a, b = parse_trajectory(dict(rec)), parse_trajectory(json.loads(json.dumps(rec)))
    assert a.trajectory_id == b.trajectory_id
    rec2 = dict(rec, agent="someone-else")
    assert parse_trajectory(rec2).trajectory_id != a.trajectory_id


def test_unknown_fields_are_preserved_not_dropped() -> None:
    rec = make_trajectory(random.Random(6))
    rec["cost_usd"] = 0.0042
    rec["items"][1]["annotations"] = ["pii-checked"]
    rec["outcome"]["judge"] = {"score": 3}
    t = parse_trajectory(rec)
    assert t.metadata["unknown_fields"] == {"cost_usd": 0.0042}
    dumped = json.loads(t.model_dump_json())
    assert dumped["items"][1]["annotations"] == ["pii-checked"]
    assert dumped["outcome"]["judge"] == {"score": 3}


def test_schema_errors_name_the_field() -> None:
    rec = make_trajectory(random.Random(8))
    rec["outcome"]["status"] = "exploded"
    result = decode(json.dumps(rec).encode(), max_bytes=1 << 20)
    assert isinstance(result, tuple)
    assert result[0] == "schema"
    assert result[1].startswith("outcome.status:")
    with pytest.raises(ValidationError):
        parse_trajectory({"agent": "a"})


def test_fast_and_general_paths_agree() -> None:
    rec = make_trajectory(random.Random(9))
    fast = decode(json.dumps(rec).encode(), max_bytes=1 << 20)
    assert fast == parse_trajectory(rec)


def test_event_union_round_trip() -> None:
    e = DeadLettered(aggregate_id="t/0/1", payload=DeadLetterPayload(
        source_topic="t", partition=0, offset=1, reason="schema", error="x", size_bytes=1,
        raw_preview="x"))
    assert parse_event(e.model_dump_json()) == e


def test_every_event_type_has_one_topic() -> None:
    """The routing table next to `Topics` covers the whole event union (a new event type
    without a topic fails here, not at its first publish)."""
    from typing import get_args

    from flywheel.config import Topics
    from flywheel.events import Event

    topics = Topics.for_prefix("p")
    union = get_args(get_args(Event)[0])
    types = [cls.model_fields["type"].default for cls in union]
    assert len(types) == 19
    for validation_event in ("ValidationScored", "CandidateProposed", "OverfittingDetected"):
        assert topics.for_event(validation_event) == "p.adapters"
    assert topics.for_event("FeedbackReceived") == "p.ingest"
    assert topics.for_event("RecordParked") == "p.parked"
    assert topics.for_event("ToolsetRegistered") == topics.for_event("ToolsetRemoved") == "p.tasks"
    assert {t: topics.for_event(t) for t in types}["GroupScored"] == "p.rollouts"
    assert {topics.for_event(t) for t in types} <= set(topics.all())
    with pytest.raises(KeyError, match=r"add it to Topics\.for_event"):
        topics.for_event("Unknown")
