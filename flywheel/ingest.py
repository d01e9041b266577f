"""Ingest logic with no I/O: raw Kafka records → trajectory rows and dead letters.

Accepts the v1 format and Chat Completions transcripts on the same topic. The fast path
validates v1 JSON straight from bytes; anything else takes the general path (decode,
normalize, validate) which also produces the readable error for the DLQ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import ValidationError

from flywheel.events import (
    DeadLettered,
    DeadLetterPayload,
    IngestedRange,
    TrajectoriesIngested,
    TrajectoriesIngestedPayload,
    derived_event_id,
)
from flywheel.schemas import Trajectory, parse_trajectory

Reason = Literal["not_json", "schema", "too_large"]


@dataclass(frozen=True, slots=True)
class RawRecord:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


@dataclass(frozen=True, slots=True)
class Accepted:
    source: RawRecord
    trajectory: Trajectory
    canonical: bool
    """True when the payload validated as-is: it is stored verbatim (no re-serialization)."""

    def record_json(self) -> str:
        if self.canonical:
            return self.source.value.decode()
        return self.trajectory.model_dump_json(exclude_none=True)


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


def decode(value: bytes, *, max_bytes: int) -> Trajectory | tuple[Reason, str]:
    """One payload → a trajectory, or (reason, error) saying why it cannot be accepted."""
    result, _ = _decode(value, max_bytes=max_bytes)
    return result


def _decode(value: bytes, *, max_bytes: int) -> tuple[Trajectory | tuple[Reason, str], bool]:
    if len(value) > max_bytes:
        return ("too_large", f"payload is {len(value)} bytes; the limit is {max_bytes}"), False
    try:
        return Trajectory.model_validate_json(value), True
    except ValidationError:
        pass  # not canonical v1: chat format, missing id, unknown fields, or really invalid
    try:
        record = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return ("not_json", f"not valid JSON: {err}"), False
    try:
        return parse_trajectory(record), False
    except ValidationError as err:
        return ("schema", describe_validation_error(err)), False
    except ValueError as err:
        return ("schema", str(err)), False


def classify(records: list[RawRecord], *, max_bytes: int) -> tuple[list[Accepted], list[Rejected]]:
    accepted: list[Accepted] = []
    rejected: list[Rejected] = []
    for rec in records:
        result, canonical = _decode(rec.value, max_bytes=max_bytes)
        if isinstance(result, Trajectory):
            accepted.append(Accepted(rec, result, canonical))
        else:
            rejected.append(Rejected(rec, result[0], result[1]))
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
            raw_preview=src.value[:1024].decode("utf-8", errors="replace"),
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
