"""Ingest's repository: trajectory rows and dead letters, added in the caller's transaction
(never committed here)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncpg.exceptions import UniqueViolationError
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.events import storable_text
from flywheel.ingest.wire import Accepted, Rejected

_INSERT_TRAJECTORIES = text("""
INSERT INTO trajectories (trajectory_id, agent, session_id, status, is_failure, model,
                          adapter_version, started_at, ended_at, source_topic,
                          source_partition, source_offset, record)
SELECT u.id, u.agent, u.session_id, u.status, u.is_failure, u.model, u.adapter_version,
       u.started_at, u.ended_at, u.topic, u.part, u.off, u.record::jsonb
FROM unnest(CAST(:ids AS uuid[]), CAST(:agents AS text[]), CAST(:sessions AS text[]),
            CAST(:statuses AS text[]), CAST(:failures AS boolean[]), CAST(:models AS text[]),
            CAST(:adapters AS text[]), CAST(:starts AS timestamptz[]),
            CAST(:ends AS timestamptz[]), CAST(:topics AS text[]), CAST(:parts AS int[]),
            CAST(:offs AS bigint[]), CAST(:records AS text[]))
     AS u(id, agent, session_id, status, is_failure, model, adapter_version, started_at,
          ended_at, topic, part, off, record)
ON CONFLICT (trajectory_id) DO UPDATE SET record = EXCLUDED.record,
    ended_at = EXCLUDED.ended_at, model = EXCLUDED.model, agent = EXCLUDED.agent,
    status = CASE WHEN trajectories.status = 'awaiting_outcome' THEN EXCLUDED.status
                  ELSE trajectories.status END,
    is_failure = trajectories.is_failure OR EXCLUDED.is_failure
  -- OTel spans of a trajectory arrive over time (the receiver re-sends the whole group when
  -- a late span of a finished trace comes): a group with more spans replaces the stored one.
  WHERE (EXCLUDED.record #>> '{metadata,otel,span_count}')::bigint
        > COALESCE((trajectories.record #>> '{metadata,otel,span_count}')::bigint, 0)
    AND trajectories.record #> '{metadata,otel}' IS NOT NULL
RETURNING is_failure, (xmax = 0) AS inserted
""")

_INSERT_DEAD_LETTERS = text("""
INSERT INTO dead_letters (topic, partition, "offset", key, raw, reason, error)
SELECT * FROM unnest(CAST(:topics AS text[]), CAST(:parts AS int[]), CAST(:offs AS bigint[]),
                     CAST(:keys AS bytea[]), CAST(:raws AS bytea[]), CAST(:reasons AS text[]),
                     CAST(:errors AS text[]))
ON CONFLICT ON CONSTRAINT uq_dead_letters_position DO NOTHING
RETURNING topic, partition, "offset"
""")

@dataclass(frozen=True)
class TrajectoryWrite:
    inserted: int
    """New rows."""
    failures: int
    """How many of the new rows are failures."""
    duplicates: int
    """Records of ids already stored, skipped."""
    replaced: int = 0
    """OTel trajectories stored again with more spans, in place of the smaller group."""


TRAJECTORY_COLUMNS = ["trajectory_id", "agent", "session_id", "status", "is_failure", "model",
                      "adapter_version", "started_at", "ended_at", "source_topic",
                      "source_partition", "source_offset", "record"]


async def insert_trajectories(conn: AsyncConnection, batch: Sequence[Accepted]) -> TrajectoryWrite:
    """Write a batch idempotently: re-delivered ids are skipped (an OTel trajectory that
    comes again with more spans replaces the stored one: late spans merged).

    Fast path: binary COPY straight into the table inside a savepoint. A batch holding an id
    that is already stored (a redelivery after a crash, or a re-sent record) violates the
    primary key; the savepoint is rolled back and the batch takes the `ON CONFLICT DO
    NOTHING` path. Either way the effect is the same rows.
    """
    if not batch:
        return TrajectoryWrite(0, 0, 0)
    try:
        async with conn.begin_nested():
            raw = await conn.get_raw_connection()
            driver: Any = raw.driver_connection
            await driver.copy_records_to_table(
                "trajectories", columns=TRAJECTORY_COLUMNS, records=[_row(a) for a in batch])
        failures = sum(a.row.is_failure for a in batch)
        return TrajectoryWrite(len(batch), failures, 0)
    except (UniqueViolationError, IntegrityError):
        return await _insert_skipping_duplicates(conn, batch)


def _row(a: Accepted) -> tuple[Any, ...]:
    r = a.row
    return (r.trajectory_id, r.agent, r.session_id, r.status, r.is_failure, r.model,
            r.adapter_version, r.started_at, r.ended_at, a.source.topic, a.source.partition,
            a.source.offset, a.record_json)


async def _insert_skipping_duplicates(conn: AsyncConnection,
                                      batch: Sequence[Accepted]) -> TrajectoryWrite:
    unique = _one_per_id(batch)
    rs = [a.row for a in unique]
    result = await conn.execute(_INSERT_TRAJECTORIES, {
        "ids": [r.trajectory_id for r in rs],
        "agents": [r.agent for r in rs],
        "sessions": [r.session_id for r in rs],
        "statuses": [r.status for r in rs],
        "failures": [r.is_failure for r in rs],
        "models": [r.model for r in rs],
        "adapters": [r.adapter_version for r in rs],
        "starts": [r.started_at for r in rs],
        "ends": [r.ended_at for r in rs],
        "topics": [a.source.topic for a in unique],
        "parts": [a.source.partition for a in unique],
        "offs": [a.source.offset for a in unique],
        "records": [a.record_json for a in unique],
    })
    rows = result.all()
    new = [failure for failure, inserted in rows if inserted]
    return TrajectoryWrite(len(new), sum(new), len(batch) - len(rows), len(rows) - len(new))


def _span_count(a: Accepted) -> int:
    if '"otel"' not in a.record_json:
        return 0
    otel = json.loads(a.record_json).get("metadata", {}).get("otel")
    return int(otel.get("span_count", 0)) if isinstance(otel, dict) else 0


def _one_per_id(batch: Sequence[Accepted]) -> list[Accepted]:
    """One record per trajectory id (a statement may touch a row once): the first, or the
    OTel group with the most spans."""
    chosen: dict[Any, Accepted] = {}
    for a in batch:
        prev = chosen.get(a.row.trajectory_id)
        if prev is None or _span_count(a) > _span_count(prev):
            chosen[a.row.trajectory_id] = a
    return list(chosen.values())


async def insert_dead_letters(
    conn: AsyncConnection, rejected: Sequence[Rejected]
) -> list[Rejected]:
    """Returns the rejections that were new (a re-delivered bad message is stored once)."""
    if not rejected:
        return []
    rows = await conn.execute(_INSERT_DEAD_LETTERS, {
        "topics": [r.source.topic for r in rejected],
        "parts": [r.source.partition for r in rejected],
        "offs": [r.source.offset for r in rejected],
        "keys": [r.source.key for r in rejected],
        "raws": [r.source.value for r in rejected],
        "reasons": [r.reason for r in rejected],
        "errors": [storable_text(r.error) for r in rejected],
    })
    new = {(t, p, o) for t, p, o in rows.all()}
    return [r for r in rejected if (r.source.topic, r.source.partition, r.source.offset) in new]
