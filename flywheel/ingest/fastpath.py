"""The ingest fast path: wire format v1 bytes → the trajectory row, without pydantic.

Owns `RowData` (what the `trajectories` table stores besides the record itself) and
`fast_decode`, a msgspec mirror of `flywheel.trajectory` that accepts a strict SUBSET of what
`Trajectory.model_validate_json` accepts and yields the same row values. Anything it is not
sure about returns None and takes the pydantic path, which owns the readable errors, chat
transcripts, derived ids and unknown top-level fields. `tests/test_ingest_fastpath.py` checks the
subset and equal-values properties differentially; change both files with `trajectory.py`.

Where msgspec alone would differ from pydantic, this module is stricter:
* numbers: msgspec never coerces ("5" or 5.0 for an int, "1.5" for a float): pydantic
  would, so those records fall back;
* datetimes are read as strings and parsed by pydantic's own datetime parser (msgspec rounds
  more than 6 fractional digits where pydantic truncates; pydantic also reads unix numbers);
* unknown nested fields are skipped by msgspec without the checks pydantic's JSON parser
  makes: UTF-8 validity, nesting depth and integer size are checked here instead.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Annotated, Literal

import msgspec
from pydantic import TypeAdapter, ValidationError

from flywheel.trajectory import (
    AWAITING_OUTCOME,
    PG_BIGINT_MAX,
    TOOL_NAME_PATTERN,
    CallStatus,
    OutcomeStatus,
    StoredDatetime,
    Trajectory,
    TrajectoryStatus,
)

# pydantic's JSON parser (jiter) refuses documents nested deeper than this (it accepts 201
# levels today; one less keeps us on the safe side) and integers longer than CPython's
# default int_max_str_digits. msgspec checks neither in the fields it skips.
MAX_DEPTH = 200
MAX_INT_DIGITS = 4300

Role = Literal["system", "developer", "user", "assistant", "tool"]
# Free-form JSON (tool parameters, content parts, metadata) is checked for syntax and kept
# as Raw, not built into Python objects: the fast path needs none of it and stores the bytes.
Json = msgspec.Raw
Content = str | list[dict[str, Json]] | None
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0, le=PG_BIGINT_MAX)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


class RowData(msgspec.Struct, frozen=True, gc=False):
    """The typed columns of one `trajectories` row (the record itself travels beside it).

    A frozen msgspec Struct rather than a dataclass: built once per record, ten times cheaper.
    """

    trajectory_id: uuid.UUID
    agent: str
    session_id: str | None
    status: TrajectoryStatus
    is_failure: bool
    model: str | None
    adapter_version: str | None
    started_at: datetime | None
    ended_at: datetime | None

    @classmethod
    def of(cls, t: Trajectory) -> RowData:
        return cls(t.trajectory_id, t.agent, t.session_id, t.status, t.is_failure,
                   t.model, t.adapter_version, t.started_at, t.ended_at)


# Python's `$` also matches before a final newline; pydantic's (Rust) regex does not.
_TOOL_NAME = TOOL_NAME_PATTERN.removesuffix("$") + r"\Z"


# Nested structs ignore unknown fields, like the `_Open` models (extra="allow"). gc=False:
# decoded JSON cannot form reference cycles, and untracked objects are cheaper to make.
class Tool(msgspec.Struct, kw_only=True, gc=False):
    type: Literal["function"] = "function"
    name: Annotated[str, msgspec.Meta(pattern=_TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Json] = msgspec.field(default_factory=dict)


class _Item(msgspec.Struct, tag_field="type", kw_only=True, gc=False):
    """Items are a union tagged on `type`; like pydantic's discriminator, the tag is required."""


class MessageItem(_Item, tag="message"):
    role: Role
    content: Content = None


class FunctionCallItem(_Item, tag="function_call"):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item, tag="function_call_output"):
    call_id: str
    output: str
    status: CallStatus = "ok"


class ReasoningItem(_Item, tag="reasoning"):
    content: Content = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class HumanIntervention(msgspec.Struct, kw_only=True, gc=False):
    by: str | None = None
    note: str | None = None
    corrected_items: list[Item] = msgspec.field(default_factory=list)


class Outcome(msgspec.Struct, kw_only=True, gc=False):
    status: OutcomeStatus
    reward: float | None = None
    error: str | None = None
    feedback: str | None = None
    human_intervention: HumanIntervention | None = None


class Usage(msgspec.Struct, kw_only=True, gc=False):
    input_tokens: NonNegativeInt | None = None
    output_tokens: NonNegativeInt | None = None


class FastTrajectory(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, gc=False):
    """Unknown top-level fields are rejected: the pydantic path moves them into metadata."""

    schema_version: Literal[1] = 1
    trajectory_id: uuid.UUID
    agent: Annotated[str, msgspec.Meta(min_length=1)]
    session_id: str | None = None
    model: str | None = None
    adapter_version: str | None = None
    started_at: str | None = None
    """Parsed by `_DATETIME` afterwards, so the value is exactly pydantic's."""
    ended_at: str | None = None
    tools: list[Tool] = msgspec.field(default_factory=list)
    items: list[Item] = msgspec.field(default_factory=list)
    outcome: Outcome | None = None
    metadata: dict[str, Json] = msgspec.field(default_factory=dict)
    usage: Usage | None = None
    latency_ms: NonNegativeFloat | None = None


_DECODER = msgspec.json.Decoder(FastTrajectory)
_DATETIME: TypeAdapter[datetime] = TypeAdapter(StoredDatetime)
_TOP_LEVEL = msgspec.json.Decoder(dict[str, msgspec.Raw])
_TOP_LEVEL_FIELDS = frozenset(Trajectory.model_fields)
# Exact on valid JSON (which is all it ever sees): outside strings JSON has no quotes.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = bytes(range(256)).replace(b"{", b"[").replace(b"}", b"]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NOT_OPENERS = bytes(b for b in range(256) if b not in b"[{")
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_TOO_MANY_DIGITS = b"0" * (MAX_INT_DIGITS + 1)


def fast_decode(value: bytes) -> RowData | None:
    """The row of a canonical v1 payload, or None: then ask pydantic (it may still accept)."""
    try:
        if not value.isascii():
            value.decode()  # skipped fields are not UTF-8-checked by msgspec
        t = _DECODER.decode(value)
    except (ValueError, RecursionError):  # msgspec.DecodeError is a ValueError
        return None
    if too_deep(value) or has_huge_number(value):
        return None
    try:
        started = None if t.started_at is None else _DATETIME.validate_python(t.started_at)
        ended = None if t.ended_at is None else _DATETIME.validate_python(t.ended_at)
    except ValidationError:
        return None
    if t.outcome is None and not t.items:
        return None  # pydantic refuses it (nothing done, no outcome) and says why
    status = t.outcome.status if t.outcome is not None else AWAITING_OUTCOME
    return RowData(t.trajectory_id, t.agent, t.session_id, status,
                   status not in ("success", AWAITING_OUTCOME), t.model, t.adapter_version,
                   started, ended)


def cannot_be_canonical(value: bytes) -> bool:
    """True when `Trajectory.model_validate_json` must fail: an unknown top-level field
    (extra="forbid") or no `trajectory_id` (required), as in every chat transcript. Saves that
    doomed attempt, which validates the whole record before it fails."""
    try:
        top = _TOP_LEVEL.decode(value)
    except (ValueError, RecursionError):
        return False  # not even a JSON object: no verdict, let pydantic say what is wrong
    return "trajectory_id" not in top or not top.keys() <= _TOP_LEVEL_FIELDS


def too_deep(value: bytes) -> bool:
    """Whether the (valid) JSON document nests arrays/objects deeper than `MAX_DEPTH`."""
    if len(value.translate(None, _NOT_OPENERS)) <= MAX_DEPTH:
        return False  # the common case: too few brackets to be that deep
    skeleton = _STRING.sub(b"", value).translate(_BRACKETS, _NOT_BRACKETS)
    # Each pass removes exactly the innermost level: `replace` does not rescan its output.
    for _ in range(MAX_DEPTH):
        if not skeleton:
            return False
        skeleton = skeleton.replace(b"[]", b"")
    return bool(skeleton)


def has_huge_number(value: bytes) -> bool:
    """Conservative: a run of digits that long, even inside a string, means "ask pydantic"."""
    return len(value) > MAX_INT_DIGITS and _TOO_MANY_DIGITS in value.translate(_DIGITS_AS_ZERO)
