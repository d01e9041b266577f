"""Ingest logic with no I/O: raw Kafka records → trajectory rows and dead letters.

Accepts the v1 format, Chat Completions transcripts and request/response pairs on the same
topic; a record without an agent is named from the message's `flywheel-agent` header
(`RawRecord.headers`), else `unknown`. Three tiers, each
a fallback for the one before: the msgspec fast path (`flywheel.ingest.fastpath`, canonical v1 only,
no pydantic object), pydantic straight from bytes (still canonical v1), and the general path
(decode, normalize, validate) which also produces the readable error for the DLQ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from flywheel.events import (
    DeadLettered,
    DeadLetterPayload,
    IngestedRange,
    TrajectoriesIngested,
    TrajectoriesIngestedPayload,
    derived_event_id,
)
from flywheel.formats import ParseContext, header_agent
from flywheel.ingest.fastpath import RowData, cannot_be_canonical, fast_decode
from flywheel.schemas import Trajectory, parse_trajectory

Reason = Literal["not_json", "schema", "too_large"]
_TOO_DEEP = ("arrays/objects are nested too deeply to store; keep nesting under 200 levels "
             "(e.g. send deep values as JSON strings)")


@dataclass(frozen=True, slots=True)
class RawRecord:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()

    @property
    def context(self) -> ParseContext:
        """What the message says about a record that leaves fields out (its agent)."""
        return ParseContext(header_agent=header_agent(self.headers))


@dataclass(frozen=True, slots=True)
class Accepted:
    source: RawRecord
    row: RowData
    record_json: str
    """What the `record` column stores: the payload verbatim when it validated as-is
    (canonical v1, no re-serialization), else the normalized trajectory's JSON."""


@dataclass(frozen=True, slots=True)
class Rejected:
    source: RawRecord
    reason: Reason
    error: str


def describe_validation_error(err: ValidationError, limit: int = 5) -> str:
    """Pydantic's errors as one readable line: `outcome.status: Input should be …; …`."""
    parts = []
    for e in err.errors()[:limit]:
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        parts.append(f"{loc}: {e['msg']}")
    more = len(err.errors()) - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def decode(value: bytes, *, max_bytes: int, context: ParseContext | None = None
           ) -> Trajectory | tuple[Reason, str]:
    """One payload → a trajectory, or (reason, error) saying why it cannot be accepted."""
    if len(value) > max_bytes:
        return _too_large(value, max_bytes)
    result, _ = _validate(value, context)
    return result


def _too_large(value: bytes, max_bytes: int) -> tuple[Reason, str]:
    return "too_large", f"payload is {len(value)} bytes; the limit is {max_bytes}"


def _validate(value: bytes, context: ParseContext | None = None
              ) -> tuple[Trajectory | tuple[Reason, str], bool]:
    """The pydantic tiers; the flag says the payload was canonical (validated as-is)."""
    if not cannot_be_canonical(value):
        try:
            return Trajectory.model_validate_json(value), True
        except ValidationError:
            pass  # not canonical v1: chat format, missing id, unknown fields, or really invalid
    try:
        record = json.loads(value)
    except ValueError as err:  # also over-long integers, beside JSONDecodeError/UnicodeError
        return ("not_json", f"not valid JSON: {err}"), False
    except RecursionError:  # bad input, not a crash: it would be redelivered forever
        return ("not_json", _TOO_DEEP), False
    try:
        return parse_trajectory(record, context), False
    except ValidationError as err:
        return ("schema", describe_validation_error(err)), False
    except ValueError as err:
        return ("schema", str(err)), False
    except RecursionError:  # deriving an id serializes the record
        return ("schema", _TOO_DEEP), False


def _unstorable(value: bytes) -> str | None:
    """Valid-looking JSON that Postgres' jsonb refuses: NUL characters, NaN/Infinity."""
    if b"\x00" in value or b"\\u0000" in value:
        return "contains a NUL character (\\u0000), which Postgres cannot store; remove it"
    if b"NaN" in value or b"Infinity" in value:
        def refuse(token: str) -> None:
            raise ValueError(token)

        try:
            json.loads(value, parse_constant=refuse)
        except ValueError as err:
            if str(err) in {"NaN", "Infinity", "-Infinity"}:
                return f"contains {err}, which is not valid JSON; send null or a number"
        except RecursionError:
            return None  # rejected later as too deep
    return None


def _classify_one(rec: RawRecord, max_bytes: int) -> Accepted | Rejected:
    value = rec.value
    if len(value) > max_bytes:
        return Rejected(rec, *_too_large(value, max_bytes))
    problem = _unstorable(value)
    if problem is not None:
        return Rejected(rec, "schema", problem)
    row = fast_decode(value)
    if row is not None:
        return Accepted(rec, row, value.decode())
    result, canonical = _validate(value, rec.context)
    if not isinstance(result, Trajectory):
        return Rejected(rec, *result)
    if canonical:
        return Accepted(rec, RowData.of(result), value.decode())
    try:
        record_json = result.model_dump_json(exclude_none=True)
    except (PydanticSerializationError, RecursionError):
        return Rejected(rec, "schema", _TOO_DEEP)
    return Accepted(rec, RowData.of(result), record_json)


def classify(records: list[RawRecord], *, max_bytes: int) -> tuple[list[Accepted], list[Rejected]]:
    accepted: list[Accepted] = []
    rejected: list[Rejected] = []
    for rec in records:
        outcome = _classify_one(rec, max_bytes)
        if isinstance(outcome, Accepted):
            accepted.append(outcome)
        else:
            rejected.append(outcome)
    return accepted, rejected


def dead_letter_event(r: Rejected) -> DeadLettered:
    """The event for a new dead letter; its id is derived from the Kafka position."""
    src = r.source
    return DeadLettered(
        event_id=derived_event_id("dead-letter", src.topic, src.partition, src.offset),
        aggregate_id=f"{src.topic}/{src.partition}/{src.offset}",
        payload=DeadLetterPayload(
            source_topic=src.topic, partition=src.partition, offset=src.offset,
            reason=r.reason, error=r.error, size_bytes=len(src.value),
            raw_preview=src.value[:1024].decode("utf-8", errors="replace").replace(
                "\x00", "\ufffd"),
        ),
    )


def ingested_event(records: list[RawRecord], *, inserted: int, duplicates: int, failures: int,
                   dead_lettered: int) -> TrajectoriesIngested:
    spans: dict[tuple[str, int], tuple[int, int]] = {}
    for rec in records:
        lo, hi = spans.get((rec.topic, rec.partition), (rec.offset, rec.offset))
        spans[(rec.topic, rec.partition)] = (min(lo, rec.offset), max(hi, rec.offset))
    ranges = [IngestedRange(topic=t, partition=p, first_offset=lo, last_offset=hi)
              for (t, p), (lo, hi) in sorted(spans.items())]
    first = ranges[0]
    return TrajectoriesIngested(
        event_id=derived_event_id("ingested", *[(r.topic, r.partition, r.first_offset,
                                                 r.last_offset) for r in ranges]),
        aggregate_id=f"{first.topic}/{first.partition}",
        payload=TrajectoriesIngestedPayload(inserted=inserted, duplicates=duplicates,
                                            failures=failures, dead_lettered=dead_lettered,
                                            ranges=ranges),
    )
