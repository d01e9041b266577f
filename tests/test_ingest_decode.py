"""The decoding boundary, family by family (pure, fast): never raises, refuses what Postgres
cannot store with the right reason, and every path (ingest, miner, gateway, SDK) decides
alike."""

from __future__ import annotations

import json
import logging
import uuid
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

import pytest

from flywheel.ingest import wire as boundary
from flywheel.ingest.storable import unstorable
from flywheel.ingest.wire import (
    Accepted,
    RawRecord,
    Rejected,
    check_trajectory,
    classify_one,
    decode,
    load_json,
    validate_record,
)
from flywheel.trajectory import Trajectory
from producers.sdk import serialize
from tests.support.poison import POISON, Poison

MAX = 64_000


def v1(**overrides: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "trajectory_id": str(uuid.uuid4()), "agent": "bot", "session_id": "s1",
        "items": [{"type": "message", "role": "user", "content": "refund order 42"}],
        "outcome": {"status": "failure", "reward": 0.0},
    }
    record.update(overrides)
    return record


def ingest(value: bytes) -> Accepted | Rejected:
    return classify_one(RawRecord("t", 0, 7, None, value), MAX)


def verdict(value: bytes) -> tuple[str | None, str]:
    """(reason or None, error) as ingest decides; also checks the other paths agree."""
    outcome = ingest(value)
    mine = decode(value, max_bytes=MAX)  # the miner
    doc = load_json(value)
    other = doc if isinstance(doc, tuple) else validate_record(doc)  # gateway, SDK, publish
    if isinstance(outcome, Accepted):
        assert isinstance(mine, Trajectory) and isinstance(other, Trajectory)
        assert mine.trajectory_id == other.trajectory_id == outcome.row.trajectory_id
        stored = json.loads(outcome.record_json)
        assert unstorable(stored) is None  # what the record column gets is storable
        assert str(outcome.row.trajectory_id) == stored["trajectory_id"]
        return None, ""
    assert mine == other == (outcome.reason, outcome.error), value[:200]
    return outcome.reason, outcome.error


@pytest.mark.parametrize("case", POISON, ids=[p.name for p in POISON])
def test_the_testers_records(case: Poison) -> None:
    reason, error = verdict(case.value)
    assert reason == case.expected, error
    assert case.says in error
    assert "nested too deeply" not in error or "nest" in case.name


def test_wrong_types_at_every_level_are_schema_errors_never_exceptions() -> None:
    wrong: list[Any] = [None, 5, -1, 1.5, True, "x", [], {}, [5], {"a": 5}, [[]], [{}]]
    base = v1(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
              messages=None)
    del base["messages"]
    chat = {"agent": "a", "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}], "outcome": {"status": "success"}}
    seen = 0
    for record in (base, chat):
        for path in paths(record):
            for value in wrong:
                reason, error = verdict(json.dumps(put(record, path, value)).encode())
                seen += 1
                assert reason in (None, "schema"), error
                assert error.count("Traceback") == 0
    for value in wrong:  # the whole record of a wrong type
        assert verdict(json.dumps(value).encode())[0] == "schema"
    assert seen > 300


def paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = []
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) \
        if isinstance(doc, list) else []
    for key, value in children:
        out.append((*prefix, key))
        out += paths(value, (*prefix, key))
    return out


def put(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    copy = json.loads(json.dumps(doc))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return copy


@pytest.mark.parametrize(("stamp", "ok"), [
    ("2026-01-01T00:00:00Z", True), ("0001-01-01T00:00:00Z", True),
    ("0001-01-01T00:00:00+00:01", False), ("9999-12-31T23:59:59Z", True),
    ("9999-12-31T23:59:59-00:01", False), ("0001-01-01T12:00:00", False),  # naive: a day clear
    ("0001-01-03T00:00:00", True), ("9999-12-30T00:00:00", True), ("9999-12-31T12:00:00", False),
    (1_700_000_000, True)])
def test_timestamps_must_be_storable_once_in_utc(stamp: Any, ok: bool) -> None:
    for field in ("started_at", "ended_at"):
        reason, error = verdict(json.dumps(v1(**{field: stamp})).encode())
        assert (reason is None) == ok, error
        if not ok:
            assert f"{field}: Value error" in error and "years 1 to 9999" in error


def test_integers_that_land_in_columns_fit_a_bigint() -> None:
    top = 2**63 - 1
    assert verdict(json.dumps(v1(usage={"input_tokens": top})).encode())[0] is None
    for bad in (top + 1, 10**30, -1):
        reason, error = verdict(json.dumps(v1(usage={"output_tokens": bad})).encode())
        assert reason == "schema" and "usage.output_tokens" in error
    # Free JSON keeps any integer jsonb holds; beyond Python's 4300 digits it is not JSON.
    assert verdict(json.dumps(v1(metadata={"n": 10**300})).encode())[0] is None
    huge = json.dumps(v1(metadata={"n": 0})).encode().replace(b'"n": 0', b'"n": ' + b"9" * 5000)
    assert verdict(huge)[0] == "not_json"


def test_nul_is_checked_on_the_decoded_value_not_the_bytes() -> None:
    def content(text: str) -> bytes:
        return json.dumps(v1(items=[{"type": "message", "role": "user",
                                     "content": text}])).encode()

    assert verdict(content("C:\\u0000file"))[0] is None  # a backslash, then u0000
    assert verdict(content("C:\\\\u0000file"))[0] is None
    for record in (content("a\x00b"), json.dumps(v1(metadata={"k\x00": 1})).encode(),
                   json.dumps(v1(agent="\x00")).encode()):
        reason, error = verdict(record)
        assert reason == "schema" and "NUL character" in error
    assert verdict(b'{"agent": "a\x00", "outcome": {"status": "success"}}')[0] == "not_json"


@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "\\ud83d", "\\ude00x", "a\\ud800\\ud800"])
def test_lone_surrogates_anywhere_are_refused_as_such(escape: str) -> None:
    template = json.dumps(v1(metadata={"KEY": "VALUE"}, session_id="SESSION"))
    for where in ("VALUE", "KEY", "SESSION"):
        reason, error = verdict(template.replace(where, escape).encode())
        assert reason == "schema" and "lone surrogate" in error, (where, error)
        assert "\\" in error or "surrogate" in error
        error.encode("utf-8")  # the error itself is storable text
    assert verdict(template.replace("VALUE", "\\ud83d\\ude00").encode())[0] is None
    encoded = template.replace("VALUE", "x").encode().replace(b'"x"', b'"\xed\xa0\x80"')
    # Encoded as UTF-8 bytes (not valid UTF-8): json.loads decodes them ("surrogatepass"),
    # so the value check sees the same lone surrogate.
    assert verdict(encoded)[0] == "schema" and "lone surrogate" in verdict(encoded)[1]


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e999",
                                   b"1" * 400 + b".0"])
def test_nan_infinity_and_overflow_are_refused_everywhere(token: bytes) -> None:
    base = json.dumps(v1(metadata={"m": "KEEP"})).encode()
    for raw in (base.replace(b'"reward": 0.0', b'"reward": ' + token),  # a typed float
                base.replace(b'"KEEP"', token)):  # free JSON
        assert raw != base
        reason, error = verdict(raw)
        assert reason == "schema" and "NaN, Infinity" in error, raw[:120]


def test_nesting_is_bounded_the_same_way_on_every_path() -> None:
    def nested(depth: int) -> bytes:  # the record itself is level 1, metadata level 2
        return json.dumps(v1(metadata={"x": "DEEP"})).encode().replace(
            b'"DEEP"', b"[" * (depth - 2) + b"]" * (depth - 2))

    assert verdict(nested(200))[0] is None
    for depth in (201, 350, 5000):
        reason, error = verdict(nested(depth))
        assert reason == "schema" and "nested too deeply" in error


def test_huge_arrays_and_duplicate_keys() -> None:
    reason, error = verdict(json.dumps(v1(items=[5] * 10_000)).encode())
    assert reason == "schema" and "and 9995 more" in error
    assert verdict(json.dumps(v1(metadata={"a": list(range(5000))})).encode())[0] is None
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    twice = json.dumps(v1(trajectory_id=second)).encode().replace(
        b"{", f'{{"trajectory_id": "{first}", '.encode(), 1)
    outcome = ingest(twice)  # the last one wins, as in Postgres' jsonb: row and record agree
    assert isinstance(outcome, Accepted) and str(outcome.row.trajectory_id) == second
    assert verdict(twice)[0] is None


def test_unknown_fields_are_kept_and_a_clash_is_explained() -> None:
    outcome = ingest(json.dumps(v1(zzz=1, metadata={"unknown_fields": {"old": 2}})).encode())
    assert isinstance(outcome, Accepted)
    assert json.loads(outcome.record_json)["metadata"]["unknown_fields"] == {"old": 2, "zzz": 1}
    reason, error = verdict(json.dumps(v1(zzz=1, metadata={"unknown_fields": []})).encode())
    assert reason == "schema" and "rename that metadata field" in error


def test_an_unexpected_exception_is_a_dead_letter_and_logged_loudly(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(record: Any, context: object = None) -> Trajectory:
        raise TypeError("'int' object is not iterable")

    monkeypatch.setattr(boundary, "parse_trajectory", broken)
    with caplog.at_level(logging.ERROR, "flywheel.ingest"):
        outcome = ingest(json.dumps({"agent": "a", "outcome": {"status": "success"}}).encode())
    assert isinstance(outcome, Rejected) and outcome.reason == "schema"
    assert outcome.error == "could not be read as a trajectory (TypeError: 'int' object is not" \
                            " iterable)"
    assert "bug in flywheel's validation" in caplog.text and "Traceback" in caplog.text


def test_python_built_trajectories_are_checked_before_publishing() -> None:
    good = Trajectory.model_validate(v1())
    assert check_trajectory(good) is None
    assert serialize(good)[1] == good.model_dump_json(exclude_none=True).encode()
    for bad in (v1(metadata={"x": float("nan")}), v1(metadata={"x": "a\x00"}),
                v1(metadata={"\ud800": 1}), v1(metadata={"x": ("ok", float("inf"))}),
                v1(metadata={"x": OrderedDict(y=["\udfff"])})):
        t = Trajectory.model_validate(bad)  # pydantic alone lets these through
        assert check_trajectory(t) is not None
        with pytest.raises(ValueError, match="invalid trajectory"):
            serialize(t)
    with pytest.raises(ValueError, match="finite number"):
        Trajectory.model_validate(v1(outcome={"status": "failure", "reward": float("inf")}))
    with pytest.raises(ValueError, match="years 1 to 9999"):
        Trajectory.model_validate(v1(started_at=datetime(1, 1, 1, tzinfo=UTC).isoformat()
                                     .replace("+00:00", "+05:00")))


@pytest.mark.parametrize("case", POISON, ids=[p.name for p in POISON])
def test_the_sdk_raises_value_error_for_what_ingest_refuses(case: Poison) -> None:
    record = load_json(case.value)
    assert not isinstance(record, tuple)
    if case.expected is None:
        serialize(record)
        return
    with pytest.raises(ValueError, match="invalid trajectory: ") as err:
        serialize(record)
    assert case.says in str(err.value)
