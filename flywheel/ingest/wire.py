"""The decoding boundary (no I/O): raw records → trajectories, rows and dead letters.

One decision for every path: ingest (`classify_one`), the miner (`decode`), the HTTP
gateway, the SDK and `flywheel publish` (`validate_record`, `check_trajectory`). Nothing
here raises on input: any failure to decode or validate one record is that record's
rejection with a readable reason, so no record can take its batch with it. Value ranges
Postgres cannot store (`flywheel.ingest.storable`, timestamps and integers in
`flywheel.trajectory`) are schema errors here, never database errors later.

Accepts the v1 format, Chat Completions transcripts, request/response pairs and OTel span
groups (`flywheel.ingest.otel`) on the same topic; a record without an agent is named from
its context (`flywheel.formats.ParseContext`:
the message's `flywheel-agent` header, `RawRecord.headers`, the gateway token, the
publisher's default), else `unknown`. The normalizers run inside the boundary: whatever they
raise is the record's rejection. Three tiers, each a fallback for the one before: the
msgspec fast path (`flywheel.ingest.fastpath`, canonical v1 only, no pydantic object),
pydantic straight from bytes (still canonical v1), and the general path (decode, check
storability, normalize, validate) which also produces the readable error for the DLQ.
Payloads whose bytes may hide an unstorable value take the general path directly.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import msgspec
from pydantic import ValidationError

from flywheel.errors import describe
from flywheel.events import (
    DeadLettered,
    DeadLetterPayload,
    IngestedRange,
    TrajectoriesIngested,
    TrajectoriesIngestedPayload,
    derived_event_id,
    preview,
    storable_text,
)
from flywheel.formats import ParseContext, header_agent
from flywheel.ingest.fastpath import (
    RowData,
    cannot_be_canonical,
    fast_decode,
    too_deep,
)
from flywheel.ingest.otel import is_otel, spans_to_record
from flywheel.ingest.storable import TOO_DEEP, text_problem, unstorable
from flywheel.trajectory import Trajectory, parse_trajectory

log = logging.getLogger("flywheel.ingest")
T = TypeVar("T")

Reason = Literal["not_json", "schema", "too_large", "unstorable"]
"""Why a record is dead-lettered. `unstorable` is the last resort: Postgres refused a record
that validation let through (a gap in validation; logged loudly), so no record can wedge a
batch even then."""
Rejection = tuple[Reason, str]
# A NUL or surrogate escape: only the decoded value can tell (`\\u0000` is no NUL).
_ESCAPES = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")
# msgspec, untyped, refuses exactly what Python's json turns into NaN or infinity (NaN,
# Infinity, 2e308, 400-digit floats), lone surrogates and over-long integers.
_ANY_JSON = msgspec.json.Decoder()


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


def validate_record(record: Any, *, plain: bool = False, context: ParseContext | None = None
                    ) -> Trajectory | Rejection:
    """One decoded JSON value → a trajectory, or why not. Never raises: the one boundary
    the gateway, the SDK, `flywheel publish`, ingest and the miner all decide with.

    `plain`: the value was decoded from a payload `sniff` found plain, so the storability
    check (`unstorable`, a walk over every value) cannot find anything and is skipped.
    `context`: where the record came from, naming the agent of a record that has none."""
    t = parse_guarded(lambda: parse_trajectory(_from_spans(record), context), record, plain,
                      "a trajectory")
    if isinstance(t, tuple):
        return t
    # The record itself was checked; an agent named by the context (a CLI argument, a
    # configured token) was not.
    problem = None if context is None else text_problem(t.agent)
    if problem is not None:
        return "schema", f"agent (from {t.metadata.get('agent_source', 'the record')}) {problem}"
    return t


def _from_spans(record: Any) -> Any:
    """An `otel_spans` record (the OTLP receiver's, `flywheel publish --format otlp-json`)
    as the v1 dict its spans make (`flywheel.ingest.otel`); any other record as it is."""
    return spans_to_record(record) if isinstance(record, dict) and is_otel(record) else record


def parse_guarded(parse: Callable[[], T], record: Any, plain: bool, what: str) -> T | Rejection:
    """`parse()` of a decoded record behind the boundary's guards; never raises. A record
    that cannot be stored (unless `plain`: nothing to find), a validation error and a gap in
    our validation (any other exception, logged as the bug it is) are schema rejections."""
    problem = None if plain else unstorable(record)
    if problem is not None:
        return "schema", problem
    try:
        return parse()
    except ValidationError as err:
        return "schema", describe_validation_error(err)
    except ValueError as err:
        return "schema", str(err)
    except Exception as err:  # a gap in our validation: refuse the record, say so loudly
        log.error("refusing a record that validation could not read as %s (%s); this is a bug "
                  "in flywheel's validation", what, describe(err), exc_info=err)
        return "schema", f"could not be read as {what} ({describe(err)})"


def check_trajectory(t: Trajectory) -> str | None:
    """Why a trajectory built in Python (not decoded) cannot be stored, or None."""
    return unstorable(t.model_dump())


def sniff(value: bytes) -> tuple[bool, Any]:
    """(plain, doc). Plain: nothing in the payload that only the value check can judge (no
    NUL or surrogate escape, no NaN, Infinity or number past a double, no over-long integer,
    not too deep), so its decoded value is storable, and `doc` is that value (msgspec's
    decoding, equal to `json.loads`'). Otherwise `(False, None)`: `load_json` it and check
    the value. A false alarm (an emoji escape) only costs the slower path."""
    if b"\\u" in value and _ESCAPES.search(value):
        return False, None
    if too_deep(value):
        return False, None
    try:
        return True, _ANY_JSON.decode(value)
    except (msgspec.DecodeError, RecursionError):
        return False, None  # not JSON, or a value the fast tiers would keep, Postgres refuse


def load_json(value: bytes) -> Any | Rejection:
    """Parse JSON text; a `Rejection` (a tuple, never a JSON value) when it is not JSON."""
    try:
        return json.loads(value)
    except RecursionError:  # valid JSON, only too deep for the parser
        return "schema", TOO_DEEP
    except ValueError as err:  # also bad UTF-8 and over-long integers
        return "not_json", f"not valid JSON: {err}"


def decode(value: bytes, *, max_bytes: int, context: ParseContext | None = None
           ) -> Trajectory | Rejection:
    """One payload → a trajectory, or (reason, error) saying why it cannot be accepted."""
    if len(value) > max_bytes:
        return _too_large(value, max_bytes)
    result, _ = _validate(value, sniff(value), context)
    return result


def _too_large(value: bytes, max_bytes: int) -> Rejection:
    return "too_large", f"payload is {len(value)} bytes; the limit is {max_bytes}"


def _validate(value: bytes, sniffed: tuple[bool, Any], context: ParseContext | None = None
              ) -> tuple[Trajectory | Rejection, bool]:
    """The pydantic tiers; the flag says the payload was canonical (validated as-is)."""
    plain, doc = sniffed
    if plain and not cannot_be_canonical(value):
        try:
            return Trajectory.model_validate_json(value), True
        except ValidationError:
            pass  # not canonical v1: chat format, missing id, unknown fields, or really invalid
    if plain:
        return validate_record(doc, plain=True, context=context), False
    doc = load_json(value)
    if isinstance(doc, tuple):
        return doc, False
    return validate_record(doc, context=context), False


def classify_one(rec: RawRecord, max_bytes: int) -> Accepted | Rejected:
    """One Kafka record → its row or its dead letter. Never raises."""
    value = rec.value
    if len(value) > max_bytes:
        return Rejected(rec, *_too_large(value, max_bytes))
    sniffed = sniff(value)
    row = fast_decode(value) if sniffed[0] else None
    if row is not None:
        return Accepted(rec, row, value.decode())
    result, canonical = _validate(value, sniffed, rec.context)
    if not isinstance(result, Trajectory):
        return Rejected(rec, *result)
    if canonical:
        return Accepted(rec, RowData.of(result), value.decode())
    try:
        record_json = result.model_dump_json(exclude_none=True)
    except Exception as err:  # unreachable after `unstorable`; refused, never raised
        return Rejected(rec, "schema", f"could not be serialized ({describe(err)})")
    return Accepted(rec, RowData.of(result), record_json)


def classify(records: list[RawRecord], *, max_bytes: int) -> tuple[list[Accepted], list[Rejected]]:
    accepted: list[Accepted] = []
    rejected: list[Rejected] = []
    for rec in records:
        outcome = classify_one(rec, max_bytes)
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
            reason=r.reason, error=storable_text(r.error), size_bytes=len(src.value),
            raw_preview=preview(src.value),
        ),
    )


def ingested_event(records: list[RawRecord], *, inserted: int, duplicates: int, failures: int,
                   dead_lettered: int, replaced: int = 0) -> TrajectoriesIngested:
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
                                            ranges=ranges, replaced=replaced),
    )
