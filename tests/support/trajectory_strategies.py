"""Hypothesis strategies: valid trajectories (v1 and chat transcripts) and everything an agent
or a broken client may send instead, each with the family it comes from and what the family
alone says must happen to it (so the property test does not only trust the code it tests).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from hypothesis import strategies as st

PG_BIGINT_MAX = 2**63 - 1


@dataclass(frozen=True)
class Sent:
    family: str
    value: bytes
    must: str | None
    """None: the family says nothing; "stored"; or a phrase the dead letter's error holds."""


TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=24)
NAME = st.text("abcdefghij_", min_size=1, max_size=8)
SESSION = st.sampled_from(["s1", "s2", "s3", "s4"])  # few sessions: retries meet failures
REQUEST = st.sampled_from(["refund order 42", "weather in Paris?", "cancel my ticket", "hi"])
FINITE = st.floats(allow_nan=False, allow_infinity=False)
LEAF = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | FINITE | TEXT
JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
ARGS = st.dictionaries(NAME, LEAF, max_size=3).map(json.dumps) | TEXT


@st.composite
def stamps(draw: st.DrawFn) -> str | int:
    """A timestamp Postgres stores: aware (any minute offset) or naive, a day from the edges."""
    when = draw(st.datetimes(min_value=datetime(1, 1, 3), max_value=datetime(9999, 12, 29)))
    kind = draw(st.sampled_from(["aware", "naive", "unix"]))
    if kind == "unix":
        return draw(st.integers(0, 4_000_000_000))
    if kind == "naive":
        return when.isoformat()
    minutes = draw(st.integers(-(23 * 60 + 59), 23 * 60 + 59))
    return when.replace(tzinfo=timezone(timedelta(minutes=minutes))).isoformat()


ITEM = st.one_of(
    st.fixed_dictionaries({"type": st.just("message"),
                           "role": st.sampled_from(["system", "user", "assistant", "tool"]),
                           "content": st.none() | TEXT | st.lists(
                               st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                               max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": NAME, "name": NAME,
                           "arguments": ARGS}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": NAME,
                           "output": TEXT, "status": st.sampled_from(["ok", "error", "timeout"])}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "content": st.none() | TEXT}),
)
PROPERTY = st.fixed_dictionaries({"type": st.sampled_from(
    ["string", "integer", "number", "boolean", "object", "array"])})
PARAMETERS = st.fixed_dictionaries(
    {"type": st.just("object"), "properties": st.dictionaries(NAME, PROPERTY, max_size=3)},
    optional={"required": st.lists(NAME, max_size=2)})
TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "name": NAME},
    optional={"description": TEXT, "x-unsafe": st.booleans(), "parameters": PARAMETERS})
FEEDBACK = TEXT | st.builds(lambda c: json.dumps({"expected_call": c}),
                            st.fixed_dictionaries({"name": NAME, "arguments": st.dictionaries(
                                NAME, LEAF, max_size=2)})) | JSON.map(json.dumps)
ENVIRONMENT = st.one_of(
    st.fixed_dictionaries({"name": st.just("code"), "tests": TEXT},
                          optional={"entrypoint": NAME | st.integers()}),
    st.fixed_dictionaries({"name": st.just("workplace"), "initial_state": st.dictionaries(
        NAME, JSON, max_size=3)}),
    st.fixed_dictionaries({"name": JSON}), JSON)
OUTCOME = st.fixed_dictionaries(
    {"status": st.sampled_from(["success", "failure", "error", "timeout", "escalated"])},
    optional={"reward": st.none() | FINITE, "error": st.none() | TEXT, "feedback": FEEDBACK,
              "human_intervention": st.fixed_dictionaries({}, optional={
                  "by": TEXT, "note": TEXT, "corrected_items": st.lists(ITEM, max_size=3)})})


@st.composite
def v1_records(draw: st.DrawFn) -> dict[str, Any]:
    items = [{"type": "message", "role": "user", "content": draw(REQUEST)}] \
        if draw(st.booleans()) else []
    record: dict[str, Any] = {"trajectory_id": str(draw(st.uuids())), "agent": draw(NAME),
                              "items": items + draw(st.lists(ITEM, max_size=5)),
                              "outcome": draw(OUTCOME)}
    optional = {
        "session_id": SESSION, "model": TEXT, "adapter_version": TEXT, "started_at": stamps(),
        "ended_at": stamps(), "tools": st.lists(TOOL, max_size=3),
        "metadata": st.dictionaries(TEXT, JSON, max_size=3) | st.builds(
            lambda env, extra: {"environment": env, **extra}, ENVIRONMENT,
            st.dictionaries(TEXT, JSON, max_size=2)),
        "usage": st.fixed_dictionaries({}, optional={"input_tokens": st.integers(0, PG_BIGINT_MAX),
                                                     "output_tokens": st.integers(0, 10**6)}),
        "latency_ms": st.floats(min_value=0, allow_nan=False, allow_infinity=False)}
    for key in draw(st.sets(st.sampled_from(sorted(optional)))):
        record[key] = draw(optional[key])
    return record


@st.composite
def chat_records(draw: st.DrawFn) -> dict[str, Any]:
    """A Chat Completions transcript, as an OpenAI-based agent logs it (no trajectory_id)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": draw(REQUEST)}]
    for turn in range(draw(st.integers(0, 3))):
        calls = draw(st.lists(st.fixed_dictionaries({"name": NAME, "arguments": ARGS
                                                      | st.dictionaries(NAME, LEAF, max_size=2)}),
                              max_size=2))
        if calls:
            ids = [f"call_{turn}_{j}" for j in range(len(calls))]
            messages.append({"role": "assistant", "content": draw(st.none() | TEXT),
                             "tool_calls": [{"id": i, "type": "function", "function": c}
                                            for i, c in zip(ids, calls, strict=True)]})
            messages += [{"role": "tool", "tool_call_id": i, "content": draw(TEXT | JSON)}
                         for i in ids]
        else:
            messages.append({"role": "assistant", "content": draw(TEXT)})
    record = {"agent": draw(NAME), "messages": messages, "outcome": draw(OUTCOME)}
    if draw(st.booleans()):
        record["session_id"] = draw(SESSION)
    if draw(st.booleans()):
        record["tools"] = [{"type": "function", "function": t} for t in draw(
            st.lists(TOOL, max_size=2))]
    return record


VALID = v1_records() | chat_records()


def _nodes(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _nodes(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _nodes(v, (*path, i))
    return out


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[path[0]] = _replace(copy[path[0]], path[1:], value)
    return copy


def _dumps(doc: Any, ascii_only: bool) -> bytes:
    return json.dumps(doc, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@st.composite
def sent(draw: st.DrawFn) -> Sent:
    """One message for the trajectories topic, from one of the families."""
    family = draw(st.sampled_from(["valid", "valid", "valid", "wrong_type", "bad_date",
                                   "big_int", "nul", "surrogate", "nan", "deep", "huge_array",
                                   "duplicate_key", "unknown_fields", "any_json", "bytes"]))
    ascii_only = draw(st.booleans())
    if family == "bytes":
        return Sent(family, draw(st.binary(max_size=64)), None)
    if family == "any_json":
        doc = draw(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                                lambda c: st.lists(c, max_size=3)
                                | st.dictionaries(st.text(), c, max_size=3), max_leaves=8))
        return Sent(family, _dumps(doc, ascii_only), None)
    record = draw(VALID)
    if family == "valid":
        return Sent(family, _dumps(record, ascii_only), "stored")
    if family == "unknown_fields":
        record = {**record, draw(NAME.map(lambda n: "x_" + n)): draw(JSON)}
        return Sent(family, _dumps(record, ascii_only), "stored")
    if family == "duplicate_key":  # JSON allows it; the last one wins everywhere
        key = draw(st.sampled_from(sorted(record)))
        body = _dumps(record, ascii_only)
        first = json.dumps({key: draw(JSON)})[1:-1].encode()
        return Sent(family, b"{" + first + b", " + body[1:], "stored")
    if family == "wrong_type":
        path = draw(st.sampled_from(_nodes(record)[1:]))
        return Sent(family, _dumps(_replace(record, path, draw(JSON)), ascii_only), None)
    if family == "bad_date":
        minutes = draw(st.integers(1, 23 * 60 + 59))
        low = draw(st.booleans())
        when = datetime(1, 1, 1) if low else datetime(9999, 12, 31, 23, 59, 59)
        stamp = when.replace(tzinfo=timezone(timedelta(minutes=minutes if low else -minutes)))
        field = draw(st.sampled_from(["started_at", "ended_at"]))
        doc = {**record, field: stamp.isoformat()}
        return Sent(family, _dumps(doc, ascii_only), "years 1 to 9999")
    if family == "big_int":
        doc = {**record, "usage": {"input_tokens": draw(st.integers(PG_BIGINT_MAX + 1, 2**80))}}
        return Sent(family, _dumps(doc, ascii_only), "usage.input_tokens")
    if family in ("nul", "surrogate"):
        bad = "\x00" if family == "nul" else draw(st.sampled_from(["\ud800", "\udbff", "\udc00",
                                                                 "\udfff"]))
        doc = _poison_a_string(record, bad, draw)
        return Sent(family, _dumps(doc, ascii_only),
                    "NUL character" if family == "nul" else "lone surrogate")
    if family == "nan":
        numbers = [p for p in _nodes(record) if p and isinstance(_at(record, p), int | float)
                   and not isinstance(_at(record, p), bool)]
        path = draw(st.sampled_from(numbers)) if numbers else ("metadata",)
        value = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        doc = _replace(record, path, value) if numbers else {**record, "metadata": {"x": value}}
        return Sent(family, _dumps(doc, ascii_only), "NaN, Infinity")
    if family == "deep":
        depth = draw(st.integers(150, 1500))
        body = _dumps({**record, "metadata": {"x": "DEEP"}}, ascii_only)
        deep = body.replace(b'"DEEP"', b"[" * depth + b"]" * depth)
        return Sent(family, deep, "stored" if depth + 2 <= 200 else "nested too deeply")
    # huge_array: near and past the payload limit
    size = draw(st.integers(1_000, 40_000))
    return Sent(family, _dumps({**record, "metadata": {"big": [0] * size}}, ascii_only), None)


def _at(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _poison_a_string(record: dict[str, Any], bad: str, draw: st.DrawFn) -> dict[str, Any]:
    """`bad` inside a string value or a key, anywhere in the record."""
    strings = [p for p in _nodes(record) if p and isinstance(_at(record, p), str)]
    objects = [p for p in _nodes(record) if isinstance(_at(record, p), dict) and _at(record, p)]
    if objects and (not strings or draw(st.booleans())):
        path = draw(st.sampled_from(objects))
        node = _at(record, path)
        key = draw(st.sampled_from(sorted(node)))
        renamed = {(k[:1] + bad + k[1:] if k == key else k): v for k, v in node.items()}
        return _replace(record, path, renamed)
    path = draw(st.sampled_from(strings))
    text = _at(record, path)
    cut = draw(st.integers(0, len(text)))
    return _replace(record, path, text[:cut] + bad + text[cut:])
