"""The msgspec fast path against pydantic, differentially, over a broad corpus.

Properties: whatever `fast_decode` accepts, `Trajectory.model_validate_json` accepts too, with
the same row (timestamps and their offsets included); `cannot_be_canonical` holds only for
records pydantic rejects; canonical v1 samples do take the fast path; `classify` gives
identical results with and without both shortcuts.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from datetime import datetime
from typing import Any, get_args

import msgspec
import pytest
from pydantic import BaseModel, ValidationError

from flywheel import trajectory as schemas
from flywheel.demo.samples import bad_payloads, make_trajectory
from flywheel.ingest import fastpath
from flywheel.ingest import wire as ingest
from flywheel.ingest.fastpath import (
    MAX_DEPTH,
    MAX_INT_DIGITS,
    RowData,
    cannot_be_canonical,
    fast_decode,
)
from flywheel.ingest.wire import RawRecord, classify
from flywheel.trajectory import Trajectory

Path = tuple[str | int, ...]
RAW = "__raw__"  # a string placeholder, replaced by raw bytes json.dumps cannot produce


def rich_record() -> dict[str, Any]:
    """A v1 record that uses every field and every item kind, nested corrections included."""
    rec: dict[str, Any] = copy.deepcopy(make_trajectory(random.Random(11)))
    rec.update(schema_version=1, adapter_version="ad-3", latency_ms=812.5,
               metadata={"env": "prod", "tags": ["a", {"b": [1, 2.5, None]}]})
    rec["tools"] = [rec["tools"][0], {"name": "noop"}]  # the second: type, params defaulted
    rec["items"] += [{"type": "reasoning", "content": [{"type": "text", "text": "hm"}]},
                     {"type": "message", "role": "developer", "content": None}]
    rec["outcome"] = {"status": "escalated", "reward": 0, "error": "e", "feedback": "f",
                      "human_intervention": {"by": "ana", "note": "n", "corrected_items": [
                          {"type": "function_call", "call_id": "fix", "name": "get_weather",
                           "arguments": "{}"},
                          {"type": "message", "role": "assistant", "content": "ok"}]}}
    return rec


def paths(obj: Any, prefix: Path = ()) -> Iterator[Path]:
    if prefix:
        yield prefix
    children = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, list) else ()
    for k, v in children:
        yield from paths(v, (*prefix, k))


def at(obj: Any, path: Path) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def mutate(rec: dict[str, Any], path: Path, value: Any = None, *, delete: bool = False
           ) -> dict[str, Any]:
    out = copy.deepcopy(rec)
    parent = at(out, path[:-1])
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


def with_raw(rec: dict[str, Any], path: Path, raw: bytes) -> bytes:
    return json.dumps(mutate(rec, path, RAW)).encode().replace(f'"{RAW}"'.encode(), raw, 1)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


WRONG: list[Any] = [None, 0, -1, 1.5, True, False, "", "x", "1", [], {}, 2**70,
                    "2026-01-01T00:00:00"]
DATETIMES: list[Any] = [
    "2026-11-01T00:00:00Z", "2026-11-01T00:00:00z", "2026-11-01 00:00:00+02:00",
    "2026-11-01T00:00:00", "2026-11-01T00:00:00.1234567Z", "2026-11-01T00:00:00.9999999Z",
    "2026-11-01T00:00:00-00:00", "2026-11-01T00:00:00+0530", "2026-11-01T00:00Z", "2026-11-01",
    "2026-11-01T00:00:00,5Z", "2026-02-30T00:00:00Z", "1700000000", 1700000000, 1700000000.5,
    "9999-12-31T23:59:59.9999999Z", "", "now"]
UUIDS: list[Any] = [
    "6b1f0c52-4a9e-4d57-9a0f-3c1d2e8b7a11", "6B1F0C52-4A9E-4D57-9A0F-3C1D2E8B7A11",
    "6b1f0c524a9e4d579a0f3c1d2e8b7a11", "{6b1f0c52-4a9e-4d57-9a0f-3c1d2e8b7a11}",
    "urn:uuid:6b1f0c52-4a9e-4d57-9a0f-3c1d2e8b7a11", "00000000-0000-0000-0000-000000000000",
    "6b1f0c52-4a9e-4d57-9a0f-3c1d2e8b7a1", 12, ""]
NUMBERS: list[Any] = [0, -0.0, -1, 1, 1.0, 0.5, 1e308, 2**63, 2**64, 10**30, "1", "1.5", True, None]
RAW_VALUES = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1" * MAX_INT_DIGITS,
              b"1" * (MAX_INT_DIGITS + 1), b"1" * (MAX_INT_DIGITS + 1) + b".5", b'"\xff"',
              b'"\xed\xa0\x80"', b'"\\ud800"', b'"\\ud800\\u0041"',
              b'"caf\xc3\xa9 \xf0\x9f\x98\x80"', b'"\\u0000"', b'{"a": 1, "a": "2"}', b"[1,]",
              b"01", b'"\\x"', b'{"\\q": 1}', b'{"\\ud800": 1}', b'{"a\x01": 1}', b"[1 , 2 ]",
              b"-0.0e-0", nested(300), nested(600), nested(1200)]
RAW_PATHS: list[Path] = [("metadata", "x"), ("outcome", "zz"), ("tools", 0, "parameters", "x"),
                         ("items", 0, "content"), ("items", 1, "zz"), ("agent",),
                         ("usage", "input_tokens"), ("latency_ms",), ("started_at",)]


def mutations() -> Iterator[bytes]:
    rich = rich_record()
    for path in list(paths(rich)):
        yield json.dumps(mutate(rich, path, delete=True)).encode()
        leaf = at(rich, path)
        number_as_string = [str(leaf)] if type(leaf) in (int, float) else []
        for value in [*WRONG, *number_as_string]:
            yield json.dumps(mutate(rich, path, value)).encode()
    for obj_path in [(), *paths(rich)]:  # an unknown field in every object, top level too
        if isinstance(at(rich, obj_path), dict):
            yield json.dumps(mutate(rich, (*obj_path, "zz_unknown"), 1)).encode()
    for field in ("started_at", "ended_at"):
        for value in DATETIMES:
            yield json.dumps(mutate(rich, (field,), value)).encode()
    for value in UUIDS:
        yield json.dumps(mutate(rich, ("trajectory_id",), value)).encode()
    for path in [("outcome", "reward"), ("latency_ms",), ("usage", "input_tokens"),
                 ("usage", "output_tokens"), ("schema_version",)]:
        for value in [*NUMBERS, 2, -1e-9]:
            yield json.dumps(mutate(rich, path, value)).encode()
    for agent in ["é", "😀", " ", "\u0000", "e\u0301", "a" * 10_000]:
        for ensure_ascii in (True, False):
            yield json.dumps(mutate(rich, ("agent",), agent), ensure_ascii=ensure_ascii).encode()
    for status in [*get_args(schemas.OutcomeStatus), "SUCCESS", "exploded"]:
        yield json.dumps(mutate(rich, ("outcome", "status"), status)).encode()
    for role in ["system", "developer", "user", "assistant", "tool", "bot"]:
        yield json.dumps(mutate(rich, ("items", 0, "role"), role)).encode()
    for kind in ["message", "function_call", "function_call_output", "reasoning", "other"]:
        yield json.dumps(mutate(rich, ("items", 2, "type"), kind)).encode()
    yield json.dumps(mutate(rich, ("tools", 0), {"type": "function", "function": {
        "name": "f", "parameters": {}}})).encode()  # Chat Completions nesting
    yield json.dumps(mutate(rich, ("tools", 0, "function"), {"name": "g"})).encode()
    for path in RAW_PATHS:
        for raw in RAW_VALUES:
            yield with_raw(rich, path, raw)
    for depth in (MAX_DEPTH - 3, MAX_DEPTH - 2, MAX_DEPTH - 1, MAX_DEPTH, 250, 1200):
        for path in [("metadata", "x"), ("outcome", "zz")]:  # decoded (Raw), and skipped
            yield with_raw(rich, path, nested(depth))
    yield json.dumps(mutate(rich, ("metadata", "x"), "[{" * 500)).encode()
    canonical = json.dumps(rich).encode()
    for dup in [b'{"agent": 5, ', b'{"agent": "", ', b'{"agent": "first", ', b'{"zz": 1, ',
                b'{"trajectory_id": "nope", ', b'{"outcome": {"status": "nope"}, ']:
        yield canonical.replace(b"{", dup, 1)
    for first in [b'"type": "reasoning"', b'"type": "message"']:  # a repeated tag
        yield canonical.replace(b'"type": "message"', first + b', "type": "message"', 1)
    yield canonical.replace(b'"agent": "', b'"agent": "\\ud83d\\ude00', 1)
    yield canonical + b" x"
    yield b"  \n" + canonical + b"\n"
    yield from [b"", b"null", b"[]", b"1", b'"x"', b"{}"]


def corpus() -> list[bytes]:
    rng = random.Random(1)
    samples = [json.dumps(make_trajectory(rng, chat_format=i % 3 == 0, with_id=i % 5 != 0,
                                          failure_rate=0.4)).encode() for i in range(600)]
    return samples + bad_payloads(rng, 40, max_bytes=20_000) + list(mutations())


CORPUS = corpus()


def pydantic_row(value: bytes) -> RowData | None:
    try:
        return RowData.of(Trajectory.model_validate_json(value))
    except ValidationError:
        return None


def test_fast_path_accepts_a_subset_of_pydantic_with_the_same_rows() -> None:
    fast = slow_only = 0
    for value in CORPUS:
        row, expected = fast_decode(value), pydantic_row(value)
        if row is None:
            slow_only += expected is not None
            continue
        fast += 1
        assert expected is not None, value[:300]
        assert row == expected, value[:300]
        for mine, theirs in [(row.started_at, expected.started_at),
                             (row.ended_at, expected.ended_at)]:
            # == alone treats 01:00+01:00 as 00:00Z; offsets and naivety must match too.
            assert (mine is None) == (theirs is None)
            if isinstance(mine, datetime) and isinstance(theirs, datetime):
                assert mine.utcoffset() == theirs.utcoffset()
                assert mine.replace(tzinfo=None) == theirs.replace(tzinfo=None)
    assert fast > 500 and slow_only > 50  # the corpus exercises both sides


def test_cannot_be_canonical_only_when_pydantic_rejects() -> None:
    skipped = 0
    for value in CORPUS:
        if cannot_be_canonical(value):
            skipped += 1
            assert pydantic_row(value) is None, value[:300]
    assert skipped > 200  # chat transcripts, id-less and unknown-field records


def test_canonical_v1_samples_take_the_fast_path() -> None:
    rng = random.Random(2)
    for _ in range(200):
        rec = make_trajectory(rng)
        assert fast_decode(json.dumps(rec).encode()) is not None
        assert fast_decode(json.dumps(rec, separators=(",", ":")).encode()) is not None
    assert fast_decode(json.dumps(rich_record()).encode()) is not None


def test_limits_are_within_what_pydantic_accepts() -> None:
    """MAX_DEPTH and MAX_INT_DIGITS are pydantic's JSON limits (or tighter): checked here."""
    rich = rich_record()
    deepest = with_raw(rich, ("metadata", "x"), nested(MAX_DEPTH - 2))
    assert pydantic_row(deepest) is not None and fast_decode(deepest) is not None
    too_deep = with_raw(rich, ("metadata", "x"), nested(MAX_DEPTH - 1))
    assert fast_decode(too_deep) is None
    longest = with_raw(rich, ("outcome", "zz"), b"9" * MAX_INT_DIGITS)
    assert pydantic_row(longest) is not None and fast_decode(longest) is not None
    assert fast_decode(with_raw(rich, ("outcome", "zz"), b"9" * (MAX_INT_DIGITS + 1))) is None
    brackets_in_strings = json.dumps(mutate(rich, ("metadata", "x"), "[{" * 500)).encode()
    assert fast_decode(brackets_in_strings) is not None


def test_classify_is_identical_without_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    records = [RawRecord("t", 0, i, None, v) for i, v in enumerate(CORPUS)]

    def run() -> tuple[list[Any], list[Any]]:
        accepted, rejected = classify(records, max_bytes=20_000)
        return ([(a.source.offset, a.row, a.record_json) for a in accepted],
                [(r.source.offset, r.reason, r.error) for r in rejected])

    with_fast = run()
    # Without either shortcut, classify is the plain pydantic pipeline it was before them.
    monkeypatch.setattr(ingest, "fast_decode", lambda value: None)
    monkeypatch.setattr(ingest, "cannot_be_canonical", lambda value: False)
    assert run() == with_fast
    assert len(with_fast[0]) > 500 and len(with_fast[1]) > 500


PAIRS: list[tuple[type[BaseModel], type[msgspec.Struct]]] = [
    (schemas.Tool, fastpath.Tool), (schemas.MessageItem, fastpath.MessageItem),
    (schemas.FunctionCallItem, fastpath.FunctionCallItem),
    (schemas.FunctionCallOutputItem, fastpath.FunctionCallOutputItem),
    (schemas.ReasoningItem, fastpath.ReasoningItem),
    (schemas.HumanIntervention, fastpath.HumanIntervention), (schemas.Outcome, fastpath.Outcome),
    (schemas.Usage, fastpath.Usage), (schemas.Trajectory, fastpath.FastTrajectory)]


@pytest.mark.parametrize(("model", "struct"), PAIRS, ids=[m.__name__ for m, _ in PAIRS])
def test_structs_mirror_the_pydantic_models(model: type[BaseModel],
                                            struct: type[msgspec.Struct]) -> None:
    """A field added to `trajectory.py` must be added here too: msgspec would skip it unchecked."""
    theirs = {name: f.is_required() for name, f in model.model_fields.items()}
    mine = {f.name: f.required for f in msgspec.structs.fields(struct)}
    if struct.__struct_config__.tag_field == "type":
        theirs.pop("type")  # the union tag: required by both pydantic's discriminator and msgspec
    assert mine == theirs
