"""The event log: append events and their outbox rows inside the caller's transaction.

Repositories add and flush, never commit; only the relay publishes the outbox.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.config import Topics
from flywheel.events import Event

_INSERT_EVENTS = text("""
INSERT INTO events (event_id, type, aggregate_id, occurred_at, schema_version, payload)
SELECT u.id, u.type, u.agg, u.at, u.version, u.payload::jsonb
FROM unnest(CAST(:ids AS uuid[]), CAST(:types AS text[]), CAST(:aggs AS text[]),
            CAST(:ats AS timestamptz[]), CAST(:versions AS int[]), CAST(:payloads AS text[]))
     AS u(id, type, agg, at, version, payload)
ON CONFLICT (event_id) DO NOTHING
RETURNING event_id
""")

_INSERT_OUTBOX = text("""
INSERT INTO outbox (event_id, topic, key, value)
SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:topics AS text[]), CAST(:keys AS text[]),
                     CAST(:vals AS bytea[]))
ON CONFLICT (event_id) DO NOTHING
""")


async def append_events(conn: AsyncConnection, events: Sequence[Event],
                        topics: Topics | None) -> int:
    """Append events and their outbox rows (each to its topic, `Topics.for_event`) in the
    caller's transaction; `topics=None` records them without publishing.

    Idempotent on `event_id`: an event already recorded is neither appended nor re-queued.
    Returns how many outbox rows were queued.
    """
    if not events:
        return 0
    result = await conn.execute(_INSERT_EVENTS, {
        "ids": [e.event_id for e in events],
        "types": [e.type for e in events],
        "aggs": [e.aggregate_id for e in events],
        "ats": [e.occurred_at for e in events],
        "versions": [e.schema_version for e in events],
        "payloads": [e.payload.model_dump_json() for e in events],
    })
    new = set(result.scalars().all())
    fresh = [e for e in events if e.event_id in new] if topics is not None else []
    if fresh:
        assert topics is not None
        await conn.execute(_INSERT_OUTBOX, {
            "ids": [e.event_id for e in fresh],
            "topics": [topics.for_event(e.type) for e in fresh],
            "keys": [e.aggregate_id for e in fresh],
            "vals": [e.model_dump_json().encode() for e in fresh],
        })
    return len(fresh)
