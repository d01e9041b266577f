"""What the bundled broker holds that nothing else does, and recovering it when it is lost.

The bundled broker keeps records in memory only, so a lost broker instance takes with it
every record a consumer group had not consumed. Three cases:

* trajectories that ingest had not stored yet exist nowhere else: they are lost. How many
  is known from the last lag read (`not_stored`), and `flywheel down` drains them first.
* trajectories ingest had stored but the miner had not mined yet are in Postgres:
  republished from `trajectories.record` (ingest dedupes them, the miner mines them).
* events from the outbox (rollout requests, scored groups, adapter events, …) are rows of
  `outbox`, marked published: marked unpublished again, so that the relay sends them to
  the new broker in their original order.

Consumers are idempotent (trajectory ids, event ids, request ids, versions): what they had
already seen is a no-op, what they had not is not lost. What is republished is bounded by
`clean_at`: per consumer group, the wall-clock time of the latest lag read (every
`stack.watch_interval_s`) in which that group had consumed everything. It is saved in
`<home>/broker-state.json` with the broker instance's start time, so that the next
`flywheel up` also knows what the previous instance may have taken with it.
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer
from sqlalchemy import text

from flywheel.db.engine import make_engine
from flywheel.runtime.kafka import send_all

STATE_FILE = "broker-state.json"
MARGIN_S = 5.0
"""Republish this much earlier than `clean_at`: clocks of Python and Postgres may differ."""
BATCH = 500

_REPUBLISH_OUTBOX = text("""
UPDATE outbox SET published_at = NULL
WHERE topic = :topic AND error IS NULL AND published_at IS NOT NULL
  AND published_at >= to_timestamp(:since)
""")
# Rows ingested from the lost instance (since it started) whose source offset some group
# had not committed: a partition missing from `starts` (never read) counts from offset 0.
_STORED_SINCE = text("""
SELECT trajectory_id, record, ingested_at FROM trajectories
WHERE ingested_at >= to_timestamp(:since) AND source_topic = :topic
  AND source_offset >= coalesce(CAST(:starts AS jsonb) ->> CAST(source_partition AS text),
                                '0')::bigint
  AND (ingested_at, trajectory_id) > (CAST(:at AS timestamptz), CAST(:after AS uuid))
ORDER BY ingested_at, trajectory_id LIMIT :n
""")


def mark_clean(clean_at: dict[str, float], lag: dict[str, int], read_at: float
               ) -> dict[str, float]:
    """`clean_at` after a lag read that started at `read_at` (pure): every group that
    reported lag 0 is clean as of `read_at`; the others keep their time."""
    return {**clean_at, **{g: read_at for g, n in lag.items() if n == 0}}


def record(state: dict[str, Any], positions: dict[str, dict[int, tuple[int, int]]],
           read_at: float) -> None:
    """Fold one read of every group's positions into a broker instance's state (pure)."""
    lag = {g: sum(max(0, h - c) for c, h in parts.values()) for g, parts in positions.items()}
    state["clean_at"] = mark_clean(state.get("clean_at") or {}, lag, read_at)
    state["lag"], state["lag_read_at"] = lag, read_at
    # JSON keys are strings: partition numbers are kept as such.
    state["committed"] = {g: {str(p): c for p, (c, _) in parts.items()}
                          for g, parts in positions.items()}


def first_unconsumed(state: dict[str, Any], groups: list[str]) -> dict[int, int]:
    """Per partition, the lowest offset one of `groups` had not committed at the last read
    (pure): records from there on may not have reached every group."""
    out: dict[int, int] = {}
    for g in groups:
        for p, c in ((state.get("committed") or {}).get(g) or {}).items():
            out[int(p)] = min(out.get(int(p), c), c)
    return out


def republish_since(clean_at: dict[str, float], broker_started_at: float | None,
                    groups: list[tuple[str, str]]) -> dict[str, float]:
    """Per topic, from when its records must be republished after losing the broker
    instance started at `broker_started_at` (pure): the oldest `clean_at` of its groups,
    never before the instance started (what came earlier was in an older instance)."""
    start = broker_started_at or 0.0
    since: dict[str, float] = {}
    for group, topic in groups:
        t = max(start, clean_at.get(group, start)) - MARGIN_S
        since[topic] = min(since.get(topic, t), t)
    return since


def load_state(home: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((home / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data


def save_state(home: Path, state: dict[str, Any]) -> None:
    path = home / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    os.replace(tmp, path)


def new_state(broker_pid: int | None, started_at: float | None) -> dict[str, Any]:
    """The state of a fresh broker instance: nothing consumed, nothing clean yet."""
    return {"broker_pid": broker_pid, "started_at": started_at, "clean_at": {},
            "lag": {}, "lag_read_at": None}


async def republish(db_url: str, bootstrap: str, since: dict[str, float],
                    trajectories_topic: str, starts: dict[int, int] | None = None
                    ) -> dict[str, int]:
    """Republish what may be lost: outbox rows of each topic published since `since`,
    and trajectories stored since `since[trajectories_topic]` from source offsets at or
    past `starts[partition]` (`first_unconsumed`); returns how many records per topic."""
    counts: dict[str, int] = {}
    engine = make_engine(db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            for topic, t in since.items():
                if topic == trajectories_topic:
                    continue
                result = await conn.execute(_REPUBLISH_OUTBOX, {"topic": topic, "since": t})
                counts[topic] = int(getattr(result, "rowcount", 0) or 0)
        if trajectories_topic in since:
            counts[trajectories_topic] = await _stored_trajectories(
                engine, bootstrap, trajectories_topic, since[trajectories_topic], starts or {})
    finally:
        await engine.dispose()
    return counts


async def _stored_trajectories(engine: Any, bootstrap: str, topic: str, since: float,
                               starts: dict[int, int]) -> int:
    """Trajectories stored since `since`, back onto their topic (keyed by id as the SDK
    does), for the groups that had not consumed them (the miner)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5,
                                max_request_size=8 * 1_048_576)
    await producer.start()
    sent = 0
    at, after = datetime(1970, 1, 1, tzinfo=UTC), "00000000-0000-0000-0000-000000000000"
    try:
        while True:  # in the order they were stored: the miner sees them as it would have
            async with engine.connect() as conn:
                rows = (await conn.execute(_STORED_SINCE, {
                    "since": since, "topic": topic, "at": at, "after": after, "n": BATCH,
                    "starts": json.dumps({str(p): o for p, o in starts.items()})})).all()
            if not rows:
                return sent
            # A fresh broker may fail some of the first writes while SDK clients resend
            # theirs (the bundled one does): those are sent again, not fatal to `up`.
            await send_all(producer, topic, [(str(tid).encode(), json.dumps(record).encode())
                                             for tid, record, _ in rows])
            sent += len(rows)
            after, at = str(rows[-1][0]), rows[-1][2]
    finally:
        await producer.stop()


def loss_report(state: dict[str, Any], groups: list[tuple[str, str]],
                trajectories_topic: str, now: float | None = None) -> dict[str, Any]:
    """What a lost broker instance held, as far as its last lag read knows (pure):
    `not_stored` trajectories ingest had not consumed (lost), and per group the lag."""
    lag: dict[str, int] = state.get("lag") or {}
    first = next((g for g, t in groups if t == trajectories_topic), None)
    read_at = state.get("lag_read_at")
    at = now or time.time()
    return {"lost_at": at, "broker_started_at": state.get("started_at"),
            "not_stored": lag.get(first) if first else None, "lag": lag,
            "lag_read_age_s": round(at - read_at, 1) if read_at else None}
