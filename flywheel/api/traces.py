"""The OTLP receiver: `POST /v1/traces` (OTLP/HTTP) → trajectories on the trajectories topic.

Point any OpenTelemetry exporter at the API (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=
http://flywheel:8000/v1/traces`, `OTEL_EXPORTER_OTLP_HEADERS="Authorization=Bearer <publish
token>"`): protobuf or JSON, gzip or not. Spans are read by `flywheel.ingest.otlp` and kept
in `otel_spans`, under the trajectory their conversation or trace makes
(`flywheel.ingest.otel.trajectory_key`); spans of a trace that came before any span naming
its conversation join that conversation when it is named. A trajectory is sent once every
trace in it has its root span (a trace is complete when its root ends, and the root ends
last); a span that comes after that re-sends the whole group, which ingest stores in place
of the smaller one.
Exports are stored one at a time (a transaction-scoped advisory lock): two exports of one
conversation at once would each see only their own new spans and publish two partial groups.
The lock is held for the few statements of one store (its cost on `flywheel bench otlp` is
not measured yet). Spans of a trajectory whose last span is older than
`ingest.otel_span_retention_s` are deleted, at most once every `PRUNE_EVERY_S` per API
process, in the background (off the request): the scan for idle trajectories runs without
the lock, and only the delete, which checks again that each is still idle, takes it.
Everything is decided by ingest's boundary (`validate_record`): a span it cannot read is
published as it came, so ingest dead-letters it with its reason, and the answer is OTLP's
partial success naming how many spans were refused and why. Re-sending an export is safe:
spans are keyed by (trajectory, trace, span) and trajectory ids are derived.

Writes `otel_spans`; publishes to `settings.topics.trajectories`; needs the operator
lifespan's database (`app.state.db`) and the gateway's producer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import defaultdict
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.api.intake import intake_of
from flywheel.api.publishing import publish_or_503, read_body
from flywheel.formats import ParseContext
from flywheel.ingest.otel import (
    OTEL_RECORD,
    conversation_of,
    span_problem,
    trajectory_id,
    trajectory_key,
)
from flywheel.ingest.otlp import BadExport, decompress, export_response, read_export
from flywheel.ingest.wire import validate_record
from flywheel.web.app import settings_of
from flywheel.web.auth import Principal, require_scope

log = logging.getLogger("flywheel.api")
PRUNE_EVERY_S = 600.0
_STORE_LOCK = 0x6F746C7073  # pg_advisory_xact_lock key of span storing ("otlps")
_LOCK = text("SELECT pg_advisory_xact_lock(:key)")
_IDLE = text("""SELECT trajectory_id FROM otel_spans GROUP BY 1
    HAVING max(received_at) < now() - make_interval(secs => :age)""")
_PRUNE = text("""DELETE FROM otel_spans WHERE trajectory_id IN (
    SELECT trajectory_id FROM otel_spans WHERE trajectory_id = ANY(CAST(:ids AS uuid[]))
    GROUP BY 1 HAVING max(received_at) < now() - make_interval(secs => :age))""")
_KNOWN = text("SELECT DISTINCT trace_id, trajectory_id FROM otel_spans "
              "WHERE trace_id = ANY(CAST(:traces AS text[]))")
_INSERT = text("""INSERT INTO otel_spans (trajectory_id, trace_id, span_id, is_root, span)
SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:traces AS text[]), CAST(:spans AS text[]),
                     CAST(:roots AS boolean[]), CAST(:bodies AS jsonb[]))
ON CONFLICT DO NOTHING""")
_MOVE = text("""WITH moved AS (DELETE FROM otel_spans WHERE trajectory_id = :old
                                AND trace_id = :trace RETURNING *)
INSERT INTO otel_spans (trajectory_id, trace_id, span_id, is_root, span, received_at)
SELECT :new, trace_id, span_id, is_root, span, received_at FROM moved ON CONFLICT DO NOTHING""")
_COMPLETE = text("""SELECT trajectory_id FROM (
    SELECT trajectory_id, trace_id, bool_or(is_root) AS rooted FROM otel_spans
    WHERE trajectory_id = ANY(CAST(:ids AS uuid[])) GROUP BY 1, 2) t
GROUP BY 1 HAVING bool_and(rooted)""")
_GROUP = text("SELECT trajectory_id, span FROM otel_spans "
              "WHERE trajectory_id = ANY(CAST(:ids AS uuid[])) ORDER BY trace_id, span_id")


def split_spans(spans: list[dict[str, Any]]) -> tuple[list[dict[str, Any]],
                                                      list[tuple[dict[str, Any], str]]]:
    """(readable spans, [(refused span, why)]) by ingest's own span check."""
    good, bad = [], []
    for span in spans:
        problem = span_problem(span)
        if problem is None:
            good.append(span)
        else:
            bad.append((span, problem))
    return good, bad


async def store_spans(engine: AsyncEngine, spans: list[dict[str, Any]]
                      ) -> dict[uuid.UUID, list[dict[str, Any]]]:
    """Keep the spans; every complete trajectory they touch, with all of its spans."""
    if not spans:
        return {}
    conv: dict[str, str] = {}
    for s in spans:
        c = conversation_of(s)
        if c and s["trace_id"] not in conv:
            conv[s["trace_id"]] = c
    traces = sorted({s["trace_id"] for s in spans})
    async with engine.begin() as conn:
        await conn.execute(_LOCK, {"key": _STORE_LOCK})
        known: dict[str, set[uuid.UUID]] = defaultdict(set)
        for t, i in (await conn.execute(_KNOWN, {"traces": traces})).all():
            known[t].add(i)
        ids = {t: trajectory_id(trajectory_key(conv[t], t)) if t in conv else
               min(known[t], default=None) or trajectory_id(trajectory_key(None, t))
               for t in traces}
        for t in conv:  # the trace's conversation is known now: its earlier spans join it
            old = trajectory_id(trajectory_key(None, t))
            if old in known[t] and old != ids[t]:
                await conn.execute(_MOVE, {"new": ids[t], "old": old, "trace": t})
        await conn.execute(_INSERT, {
            "ids": [ids[s["trace_id"]] for s in spans],
            "traces": [s["trace_id"] for s in spans], "spans": [s["span_id"] for s in spans],
            "roots": [not s.get("parent_span_id") for s in spans],
            "bodies": [json.dumps(s) for s in spans]})
        touched = sorted(set(ids.values()))
        complete = [r[0] for r in (await conn.execute(_COMPLETE, {"ids": touched})).all()]
        groups: dict[uuid.UUID, list[dict[str, Any]]] = defaultdict(list)
        if complete:
            for tid, body in (await conn.execute(_GROUP, {"ids": complete})).all():
                groups[tid].append(body)
    return dict(groups)


async def prune_spans(engine: AsyncEngine, older_than_s: float) -> int:
    """Delete the spans of every trajectory whose last span came over `older_than_s` ago.
    The table scan holds no lock; the delete holds the store lock and checks again, so a
    span stored meanwhile keeps its trajectory."""
    async with engine.connect() as conn:
        ids = list((await conn.execute(_IDLE, {"age": older_than_s})).scalars())
    if not ids:
        return 0
    async with engine.begin() as conn:
        await conn.execute(_LOCK, {"key": _STORE_LOCK})
        return (await conn.execute(_PRUNE, {"ids": ids, "age": older_than_s})).rowcount or 0


def _maybe_prune(request: Request, older_than_s: float) -> None:
    """Start a prune in the background when the last one is `PRUNE_EVERY_S` old."""
    state = request.app.state
    now = time.monotonic()
    if now < getattr(state, "otel_prune_at", 0.0):
        return
    state.otel_prune_at = now + PRUNE_EVERY_S

    async def prune() -> None:
        try:
            deleted = await prune_spans(state.db, older_than_s)
        except Exception as err:  # retried at the next interval; never fails an export
            log.warning("OTLP: pruning idle spans failed (%s)", err)
            return
        if deleted:
            log.info("OTLP: deleted %d spans of trajectories idle for over %.0f s "
                     "(ingest.otel_span_retention_s)", deleted, older_than_s)

    state.otel_prune = asyncio.create_task(prune())  # held: a task nobody holds may vanish


def to_publish(groups: dict[uuid.UUID, list[dict[str, Any]]],
               bad: list[tuple[dict[str, Any], str]], context: ParseContext,
               max_payload_bytes: int) -> tuple[list[tuple[bytes, bytes]], int, list[str]]:
    """(Kafka records, refused span count, reasons): each complete group as its trajectory,
    each refused span or group as it came (ingest dead-letters it with the same reason).
    A record over `ingest.max_payload_bytes` is refused here, as the gateway refuses one: the
    broker would refuse it, and every later export of that conversation with it."""
    records: list[tuple[bytes, bytes]] = []
    refused, reasons = 0, []

    def add(key: bytes, value: bytes, spans: int, what: str) -> None:
        nonlocal refused
        if len(value) > max_payload_bytes:
            refused += spans
            reasons.append(f"{what} is {len(value)} bytes: one trajectory may be at most "
                           f"{max_payload_bytes} bytes (ingest.max_payload_bytes)")
        else:
            records.append((key, value))

    for tid, spans in sorted(groups.items()):
        result = validate_record({OTEL_RECORD: spans}, context=context)
        key = str(tid).encode()
        if isinstance(result, tuple):
            refused += len(spans)
            reasons.append(result[1])
            add(key, json.dumps({OTEL_RECORD: spans}).encode(), 0, f"trajectory {tid}")
        else:
            add(key, result.model_dump_json(exclude_none=True).encode(), len(spans),
                f"trajectory {tid} ({len(spans)} spans)")
    for span, reason in bad:
        refused += 1
        reasons.append(reason)
        add(b"", json.dumps({OTEL_RECORD: [span]}, default=str).encode(), 0, "a refused span")
    return records, refused, reasons


def traces_router() -> APIRouter:
    """`POST /v1/traces`; mount with the gateway's and the operator's lifespans."""
    router = APIRouter(tags=["trajectories"])

    @router.post("/v1/traces")
    async def post_traces(request: Request, principal: Principal = require_scope("publish")
                          ) -> Response:
        """OTLP/HTTP trace export (protobuf or JSON, gzip): GenAI spans become trajectories."""
        async with intake_of(request.app).admit():
            settings = settings_of(request)
            limit = settings.api.max_request_bytes
            ctype = request.headers.get("content-type")
            body = await read_body(request, limit)
            try:
                body = decompress(body, request.headers.get("content-encoding"), limit)
                spans = await asyncio.to_thread(read_export, body, ctype)
            except BadExport as err:
                raise HTTPException(400, str(err)) from None
            good, bad = split_spans(spans)
            _maybe_prune(request, settings.ingest.otel_span_retention_s)
            groups = await store_spans(request.app.state.db, good)
            records, refused, reasons = await asyncio.to_thread(
                to_publish, groups, bad, ParseContext(token_agent=principal.agent),
                settings.ingest.max_payload_bytes)
            if records:
                await publish_or_503(request, settings.topics.trajectories, records,
                                     what="trajectories from spans",
                                     dedupe="spans and trajectory ids are derived")
            message = "; ".join(reasons[:5]) + (f"; and {len(reasons) - 5} more"
                                                 if len(reasons) > 5 else "")
            content, media = export_response(refused, message, ctype)
            return Response(content, media_type=media)

    return router
