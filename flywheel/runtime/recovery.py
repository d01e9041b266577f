"""What the bundled broker holds that nothing else does, and recovering it when it is lost.

The bundled broker keeps records in memory only. Two kinds of record pass through it:

* trajectories from agents (SDK, gateway, any Kafka client): Postgres has them only once
  ingest stored them. The broker's loss takes whatever ingest (and the miner) had not
  consumed yet; nothing can bring those back, so `flywheel down` drains them first and a
  crash is reported with the lag last seen (`at_risk`).
* events from the outbox (rollout requests, scored groups, adapter events, …): every one
  is still a row of `outbox`, marked published. After a loss the rows published since the
  last moment every consumer of their topic had consumed everything are marked unpublished
  again, and the relay sends them to the new broker, in their original order. Consumers
  are idempotent (event ids, request ids, versions), so what they had already seen is a
  no-op and what they had not is not lost.

The supervisor reads every group's lag every `stack.watch_interval_s` and keeps, per topic,
`clean_at`: the wall-clock time of the latest read in which every group on that topic had
lag 0. It is saved in `<home>/broker-state.json` with the broker instance's start time, so
the next `flywheel up` (after a crash of everything, or a `down` whose drain ran out of
time) knows what the previous broker instance may have taken with it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text

from flywheel.db.engine import make_engine

STATE_FILE = "broker-state.json"
MARGIN_S = 5.0
"""Republish this much earlier than `clean_at`: clocks of Python and Postgres may differ."""

_REPUBLISH = text("""
UPDATE outbox SET published_at = NULL
WHERE topic = :topic AND error IS NULL AND published_at IS NOT NULL
  AND published_at >= to_timestamp(:since)
""")


def mark_clean(clean_at: dict[str, float], lag: dict[str, int],
               groups: list[tuple[str, str]], read_at: float) -> dict[str, float]:
    """`clean_at` after a lag read that started at `read_at` (pure).

    A topic becomes clean at `read_at` when every group consuming it reported lag 0; a
    group missing from `lag` (the read failed) leaves its topic as it was."""
    topics: dict[str, list[str]] = {}
    for group, topic in groups:
        topics.setdefault(topic, []).append(group)
    out = dict(clean_at)
    for topic, members in topics.items():
        if all(lag.get(g) == 0 for g in members):
            out[topic] = read_at
    return out


def republish_since(clean_at: dict[str, float], broker_started_at: float | None,
                    groups: list[tuple[str, str]]) -> dict[str, float]:
    """Per consumed topic, from when outbox rows must be republished after losing the
    broker instance started at `broker_started_at` (pure). A topic never seen clean
    republishes everything that instance received."""
    start = broker_started_at or 0.0
    return {topic: max(start, clean_at.get(topic, start)) - MARGIN_S
            for topic in dict.fromkeys(t for _, t in groups)}


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


async def republish(db_url: str, since: dict[str, float]) -> dict[str, int]:
    """Mark outbox rows of each topic published since `since[topic]` unpublished again (the
    relay sends them); returns how many per topic."""
    engine = make_engine(db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            counts = {}
            for topic, t in since.items():
                result = await conn.execute(_REPUBLISH, {"topic": topic, "since": t})
                counts[topic] = int(getattr(result, "rowcount", 0) or 0)
        return counts
    finally:
        await engine.dispose()


def loss_report(state: dict[str, Any], groups: list[tuple[str, str]],
                trajectories_topic: str, now: float | None = None) -> dict[str, Any]:
    """What a lost broker instance held, as far as the last lag read knows (pure)."""
    lag: dict[str, int] = state.get("lag") or {}
    at_risk = max((lag[g] for g, t in groups if t == trajectories_topic and g in lag),
                  default=None)
    read_at = state.get("lag_read_at")
    return {"lost_at": now or time.time(), "broker_started_at": state.get("started_at"),
            "trajectories_at_risk": at_risk,
            "lag_read_age_s": round((now or time.time()) - read_at, 1) if read_at else None}
