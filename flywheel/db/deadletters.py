"""Parked messages: a consumer's dead letter (`dead_letters` row + `RecordParked` event),
added in the caller's transaction (never committed here). Ingest's own dead letters
(`DeadLettered`) are written by `flywheel.ingest.store` into the same table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.config import Topics
from flywheel.db.outbox import append_events
from flywheel.errors import Failure
from flywheel.events import (
    RecordParked,
    RecordParkedPayload,
    derived_event_id,
    preview,
    storable_text,
)

_PARK = text("""
INSERT INTO dead_letters (consumer, topic, partition, "offset", key, raw, reason, error)
SELECT * FROM unnest(CAST(:consumers AS text[]), CAST(:topics AS text[]),
                     CAST(:parts AS int[]), CAST(:offs AS bigint[]), CAST(:keys AS bytea[]),
                     CAST(:raws AS bytea[]), CAST(:reasons AS text[]), CAST(:errors AS text[]))
ON CONFLICT ON CONSTRAINT uq_dead_letters_position DO NOTHING
RETURNING topic, partition, "offset"
""")


@dataclass(frozen=True, slots=True)
class Parked:
    consumer: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    failure: Failure


async def park(conn: AsyncConnection, parked: Sequence[Parked], topics: Topics) -> int:
    """Store each message as a dead letter of its consumer and append `RecordParked`;
    idempotent per (consumer, position). Returns how many were new."""
    if not parked:
        return 0
    rows = await conn.execute(_PARK, {
        "consumers": [p.consumer for p in parked], "topics": [p.topic for p in parked],
        "parts": [p.partition for p in parked], "offs": [p.offset for p in parked],
        "keys": [p.key for p in parked], "raws": [p.value for p in parked],
        "reasons": [p.failure.kind for p in parked],
        "errors": [storable_text(p.failure.error) for p in parked],
    })
    new = {(t, part, o) for t, part, o in rows.all()}
    events = [RecordParked(
        event_id=derived_event_id("parked", p.consumer, p.topic, p.partition, p.offset),
        aggregate_id=f"{p.topic}/{p.partition}/{p.offset}",
        payload=RecordParkedPayload(
            consumer=p.consumer, source_topic=p.topic, partition=p.partition, offset=p.offset,
            reason=p.failure.kind, error=storable_text(p.failure.error),
            size_bytes=len(p.value), raw_preview=preview(p.value)))
        for p in parked if (p.topic, p.partition, p.offset) in new]
    await append_events(conn, events, topics)
    return len(events)
