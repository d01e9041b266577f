"""The decoding boundary for what `flywheel.formats` added: feedback records, and agents
named by the context. Pure: no broker, no database."""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

import pytest
from fastapi import HTTPException

from flywheel.api.feedback_routes import parse_feedback_body
from flywheel.feedback import Feedback, parse_feedback
from flywheel.formats import ParseContext, header_agent
from flywheel.ingest.feedback_wire import decode_feedback, validate_feedback
from flywheel.ingest.wire import RawRecord, Rejected, classify_one, decode
from producers.feedback_client import serialize_feedback
from tests.support.poison import pair

MAX = 1 << 20
TID = "5f0c4a55-5d3b-4c1e-9a57-0d6f3c9e2b10"

BAD_FEEDBACK: list[tuple[str, bytes, str, str]] = [
    ("not json", b"{rating: up}", "not_json", "not valid JSON"),
    ("not an object", b"5", "schema", "feedback must be a JSON object, got int"),
    ("names nothing", b'{"rating": "up"}', "schema", "names no trajectory"),
    ("says nothing", b'{"request_id": "r"}', "schema", "feedback says nothing"),
    ("a NUL", b'{"request_id": "r", "note": "a\\u0000b"}', "schema", "note: contains a NUL"),
    ("a lone surrogate in a key", b'{"request_id": "r", "rating": "up", "metadata": '
     b'{"k\\ud800": 1}}', "schema", "a key contains a lone surrogate"),
    ("NaN reward", b'{"request_id": "r", "outcome": {"status": "failure", "reward": NaN}}',
     "schema", "NaN, Infinity"),
    ("unknown_fields not an object", b'{"request_id": "r", "rating": "up", "x": 1, '
     b'"metadata": {"unknown_fields": [1]}}', "schema", "unknown_fields must be an object"),
    ("too deep", b'{"request_id": "r", "note": "n", "metadata": {"x": ' + b"[" * 300
     + b"]" * 300 + b"}}", "schema", "nested too deeply"),
    ("correction not items", b'{"request_id": "r", "correction": [{"role": "tool"}]}',
     "schema", "needs 'tool_call_id'"),
]


@pytest.mark.parametrize(("name", "value", "reason", "says"), BAD_FEEDBACK,
                         ids=[c[0] for c in BAD_FEEDBACK])
def test_bad_feedback_is_refused_alike_by_the_miner_gateway_and_producers(
        name: str, value: bytes, reason: str, says: str) -> None:
    refused = decode_feedback(value, max_bytes=MAX)
    assert isinstance(refused, tuple) and refused[0] == reason and says in refused[1], refused
    with pytest.raises(HTTPException) as http:
        parse_feedback_body(value, ref=None)
    assert refused[1] in str(http.value.detail)
    assert http.value.status_code == (400 if reason == "not_json" else 422)
    if reason != "not_json":
        with pytest.raises(ValueError, match="invalid feedback: ") as err:
            serialize_feedback(json.loads(value))
        assert refused[1] in str(err.value)


def test_wrong_types_anywhere_are_refusals_never_exceptions() -> None:
    wrong: list[Any] = [None, 5, -1, 1.5, True, "x", [], {}, [5], {"a": 5}, [[]], [{}]]
    base = {"request_id": "r", "rating": "down", "outcome": {"status": "failure"},
            "feedback": {"expected_call": {"name": "refund"}}, "correction": [
                {"role": "assistant", "content": "sorry"}], "by": "lead", "note": "n",
            "created_at": "2026-01-01T00:00:00Z", "metadata": {}}
    for field in base:
        for value in wrong:
            result = validate_feedback({**base, field: value})
            assert isinstance(result, Feedback | tuple), (field, value)


def test_too_large_and_the_url_target() -> None:
    assert decode_feedback(b'{"request_id": "r", "rating": "up"}', max_bytes=10) == (
        "too_large", "payload is 35 bytes; the limit is 10")
    fb = validate_feedback({"rating": "up"}, trajectory_id=uuid.UUID(TID))
    assert isinstance(fb, Feedback) and str(fb.trajectory_id) == TID
    clash = validate_feedback({"trajectory_id": str(uuid.uuid4()), "rating": "up"},
                              trajectory_id=uuid.UUID(TID))
    assert isinstance(clash, tuple) and "the URL names" in clash[1]


def test_a_feedback_built_in_python_is_checked_too() -> None:
    fb = parse_feedback({"request_id": "r", "outcome": {"status": "failure"}})
    nan = fb.model_copy(update={"outcome": fb.outcome.model_copy(  # type: ignore[union-attr]
        update={"reward": math.nan})})
    with pytest.raises(ValueError, match=r"invalid feedback: .*NaN"):
        serialize_feedback(nan)
    good, value = serialize_feedback(fb)
    assert json.loads(value)["feedback_id"] == str(good.feedback_id)


def test_an_agent_header_that_cannot_be_stored_is_ignored_like_a_blank_one() -> None:
    assert header_agent([("flywheel-agent", b"go-bot")]) == "go-bot"
    for bad in (b"a\x00b", b"\xff", b"  ", "x\udc00"):
        assert header_agent([("flywheel-agent", bad)]) is None, bad
    record = RawRecord("t", 0, 0, None, json.dumps(pair()).encode(),
                       (("flywheel-agent", b"a\x00b"),))
    outcome = classify_one(record, MAX)
    assert not isinstance(outcome, Rejected) and outcome.row.agent == "unknown"


def test_an_agent_the_publisher_names_is_checked_like_the_record() -> None:
    value = json.dumps(pair()).encode()
    named = decode(value, max_bytes=MAX, context=ParseContext(publisher_agent="cli-bot"))
    assert not isinstance(named, tuple)
    assert (named.agent, named.metadata["agent_source"]) == ("cli-bot", "publisher")
    refused = decode(value, max_bytes=MAX, context=ParseContext(token_agent="a\x00b"))
    assert refused == ("schema", "agent (from token) contains a NUL character (\\u0000), "
                                 "which Postgres cannot store; remove it (the text "
                                 "backslash-u0000 is fine)")
    own = json.dumps({**pair(), "agent": "mine"}).encode()
    kept = decode(own, max_bytes=MAX, context=ParseContext(token_agent="a\x00b"))
    assert not isinstance(kept, tuple) and kept.agent == "mine"  # the context is not used
