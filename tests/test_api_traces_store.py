"""The OTLP receiver's span store (`flywheel.api.traces.store_spans`) on the real Postgres:
concurrent exports of one conversation, and the retention of idle trajectories' spans."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.api import traces
from flywheel.ingest.otel import OTEL_RECORD
from flywheel.ingest.otlp import read_export
from flywheel.ingest.store import insert_trajectories
from flywheel.ingest.wire import RawRecord, classify
from tests.support.otel_agent import converse, provider
from tests.test_ingest_otel import scripted_model

pytestmark = pytest.mark.postgres
PROTOBUF = "application/x-protobuf"


def two_turns(conversation: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The spans of two turns (two traces, each with its root) of one conversation."""
    out = []
    for question in ("What is 5 factorial?", "And 6 factorial?"):
        exporter = InMemorySpanExporter()
        tp = provider("calc-service", SimpleSpanProcessor, exporter)
        converse(tp, scripted_model, style="genai", conversation=conversation,
                 question=question)
        tp.shutdown()
        out.append(read_export(encode_spans(exporter.get_finished_spans())
                               .SerializeToString(), PROTOBUF))
    return out[0], out[1]


async def test_concurrent_exports_of_one_conversation_publish_it_whole(
        engine: AsyncEngine) -> None:
    # Two exporters (two processes of one agent) send a turn each at the same moment.
    # Whichever stores second must see the other's spans: its group is the whole
    # conversation. Without the store lock both could read before either commits and
    # publish two partial groups, neither of them the conversation.
    for trial in range(12):
        first, second = two_turns(f"conv-{trial}")
        a, b = await asyncio.gather(traces.store_spans(engine, first),
                                    traces.store_spans(engine, second))
        sizes = sorted(len(spans) for g in (a, b) for spans in g.values())
        assert sizes[-1] == len(first) + len(second), (trial, sizes)


async def test_a_store_waits_for_one_in_progress(engine: AsyncEngine) -> None:
    first, second = two_turns("conv-wait")
    async with engine.connect() as held:
        await held.execute(text("SELECT pg_advisory_xact_lock(:k)"),
                           {"k": traces._STORE_LOCK})
        pending = asyncio.ensure_future(traces.store_spans(engine, first))
        done, _ = await asyncio.wait({pending}, timeout=1.0)
        assert not done  # another export is between reading and committing: wait for it
        await held.rollback()
    assert len((await pending).popitem()[1]) == len(first)
    groups = await traces.store_spans(engine, second)
    assert len(groups.popitem()[1]) == len(first) + len(second)


async def test_spans_of_idle_trajectories_are_pruned(engine: AsyncEngine) -> None:
    old, _ = two_turns("conv-old")
    fresh, _ = two_turns("conv-fresh")
    await traces.store_spans(engine, old)
    await traces.store_spans(engine, fresh)
    async with engine.begin() as conn:
        (old_id,) = (await conn.execute(text(
            "SELECT DISTINCT trajectory_id FROM otel_spans WHERE trace_id = :t"),
            {"t": old[0]["trace_id"]})).scalars().all()
        # One span of the old conversation is recent: the conversation is not idle yet.
        await conn.execute(text("UPDATE otel_spans SET received_at = now() - interval '2 days'"
                                " WHERE trajectory_id = :i AND span_id <> :s"),
                           {"i": old_id, "s": old[0]["span_id"]})
    assert await traces.prune_spans(engine, 24 * 3600) == 0
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE otel_spans SET received_at = now() - interval '2 days'"
                                " WHERE trajectory_id = :i"), {"i": old_id})
    assert await traces.prune_spans(engine, 24 * 3600) == len(old)
    async with engine.connect() as conn:
        left = (await conn.execute(text("SELECT count(*) FROM otel_spans"))).scalar_one()
    assert left == len(fresh)


async def test_a_regrown_conversation_is_replaced_not_counted_as_new(
        engine: AsyncEngine) -> None:
    # What ingest writes of the receiver's groups: the first turn is a new row; the whole
    # conversation, re-sent once its second turn came, replaces it (not a second new row, not
    # a second failure); the same group again is a duplicate.
    first, second = two_turns("conv-grown")
    one = await traces.store_spans(engine, first)
    both = await traces.store_spans(engine, second)
    (tid,) = one
    raws = [RawRecord("t.trajectories", 0, n, None, json.dumps({OTEL_RECORD: spans}).encode())
            for n, spans in enumerate([one[tid], both[tid], both[tid]])]
    accepted, rejected = classify(raws, max_bytes=1 << 20)
    assert not rejected
    writes = []
    for a in accepted:
        async with engine.begin() as conn:
            writes.append(await insert_trajectories(conn, [a]))
    assert [(w.inserted, w.replaced, w.duplicates) for w in writes] == [
        (1, 0, 0), (0, 1, 0), (0, 0, 1)]
    async with engine.connect() as conn:
        spans = (await conn.execute(text(
            "SELECT (record #>> '{metadata,otel,span_count}')::int FROM trajectories"))
        ).scalars().all()
    assert spans == [len(first) + len(second)]
