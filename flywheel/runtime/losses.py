"""What a lost bundled broker took with it, counted exactly, and kept until an operator
acknowledges it (`flywheel losses ack`).

While the broker lives, every lag read (`Stack._watch`, the drain's last read before `down`
stops the broker) also reads the keys of the records the storing group has not committed
yet (`unstored`): for trajectories the key is the trajectory id. When the instance is lost,
its loss per topic is what it had acknowledged up to its last read and Flywheel has not
stored: the ids not found in Postgres (a row or a dead letter), plus the records read by
count only (no key, or past `KEY_CAP`). Producers that hold what they sent until it is stored
(`producers.confirm`) send those records again to the next broker: as they are stored the
loss shrinks (`Losses.recount`), so what stays counted is what nobody will send again
(a raw Kafka producer's records). Feedback is counted by offsets only (its key is the
trajectory it is about, not its own id). An instance lost before any read of it has a loss
that is not known (`not_stored` None), never 0; and what an instance acknowledged after its
last read is not counted (the loss says how long before it was lost that read came). A loss
stays in `flywheel status` until an operator acknowledges it; `<home>/losses.json` keeps it
across restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from sqlalchemy import text

from flywheel.config import Settings
from flywheel.db.engine import make_engine

LOSSES_FILE = "losses.json"
ACKED_FILE = "losses-acked.json"
KEY_CAP = 50_000
"""Most keys read per topic and lag read: beyond that records are counted, not named."""

_STORED = text("""
SELECT trajectory_id::text FROM trajectories WHERE trajectory_id = ANY(CAST(:uuids AS uuid[]))
UNION SELECT encode(key, 'escape') FROM dead_letters
WHERE key IS NOT NULL AND key = ANY(CAST(:keys AS bytea[]))
""")

Positions = dict[int, tuple[int, int]]
"""Per partition: (committed offset, highwater)."""


async def unstored(bootstrap: str, topic: str, positions: Positions,
                   cap: int = KEY_CAP, timeout_s: float = 5.0) -> dict[str, list[Any]]:
    """Per partition (as a string), `[offset, key]` of each record in [committed, highwater):
    what the broker acknowledged and the group has not stored yet (`key` None if it has
    none). Partitions it could not read in time are left out (counted by offsets)."""
    todo = {TopicPartition(topic, p): (c, h) for p, (c, h) in positions.items() if h > c}
    if not todo:
        return {}
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                                enable_auto_commit=False, max_partition_fetch_bytes=1 << 20)
    out: dict[str, list[Any]] = {}
    try:
        await consumer.start()
        consumer.assign(list(todo))
        for tp, (c, _) in todo.items():
            consumer.seek(tp, c)
        read = 0
        async with asyncio.timeout(timeout_s):
            while todo and read < cap:
                batch = await consumer.getmany(*todo, timeout_ms=200, max_records=cap - read)
                for tp, msgs in batch.items():
                    high = todo[tp][1]
                    keep = [[m.offset, m.key.decode("utf-8", "replace") if m.key else None]
                            for m in msgs if m.offset < high]
                    out.setdefault(str(tp.partition), []).extend(keep)
                    read += len(keep)
                    if msgs and msgs[-1].offset + 1 >= high:
                        todo.pop(tp)
    except TimeoutError:
        pass  # what was not read is counted by offsets
    finally:
        await consumer.stop()
    return out


class KeyTail:
    """The keys of one topic's records on one broker instance, read as they come: per
    partition offset → key, from the offset the storing group had committed when the tail
    first saw the partition, trimmed below what it has committed since. One consumer for
    the instance's life, so each lag read reads only the records that arrived since the
    one before, a fetch or two. (`unstored` reads every uncommitted key afresh at each lag
    read: a consumer start and a fetch of the whole backlog, seconds on a loaded machine.
    A broker killed in that window took records whose keys were never read, and those are
    counted as lost even when their producers send them again.)

    Not thread-safe: one event loop uses it (the supervisor's watch)."""

    def __init__(self, bootstrap: str, topic: str, instance: Any, cap: int = KEY_CAP) -> None:
        self.bootstrap, self.topic, self.instance, self.cap = bootstrap, topic, instance, cap
        """`instance`: what names the broker instance (its pid); a new one needs a new tail."""
        self._keys: dict[int, dict[int, Any]] = {}
        self._next: dict[int, int] = {}
        """Per partition, the next offset the tail reads."""
        self._consumer: AIOKafkaConsumer | None = None

    def held(self) -> int:
        return sum(len(k) for k in self._keys.values())

    async def read(self, targets: dict[int, int] | None = None, timeout_s: float = 2.0) -> None:
        """Read what arrived, up to each partition's offset in `targets` (its highwater; None:
        until a fetch returns nothing), or until `cap` keys are held, or `timeout_s`."""
        if self._consumer is None or not self._next:
            return
        want = {p: t for p, t in (targets or {}).items() if p in self._next}
        try:
            async with asyncio.timeout(timeout_s):
                while self.held() < self.cap:
                    todo = [TopicPartition(self.topic, p) for p in self._next
                            if targets is None or self._next[p] < want.get(p, 0)]
                    if not todo:
                        return
                    # Longer than a fetch's wait on the broker: empty means nothing came.
                    batch = await self._consumer.getmany(*todo, timeout_ms=300,
                                                         max_records=self.cap - self.held())
                    if not any(batch.values()) and targets is None:
                        return
                    for tp, msgs in batch.items():
                        keys = self._keys.setdefault(tp.partition, {})
                        for m in msgs:
                            keys[m.offset] = m.key.decode("utf-8", "replace") if m.key else None
                        if msgs:
                            self._next[tp.partition] = msgs[-1].offset + 1
        except TimeoutError:
            pass  # read on at the next lag read; what is unread is counted by offsets

    async def keys(self, positions: Positions, timeout_s: float = 2.0) -> dict[str, list[Any]]:
        """`[offset, key]` per partition (as a string) in [committed, highwater) of one read of
        the storing group's `positions`, as far as the tail has read them, after reading on
        towards each highwater (`unstored`'s shape). Partitions new to the tail are read from
        their committed offset; keys below it are dropped."""
        new = {p: c for p, (c, _) in positions.items() if p not in self._next}
        for p, (committed, _) in positions.items():
            keys = self._keys.get(p)
            if keys:
                for off in [o for o in keys if o < committed]:
                    del keys[off]
        if new:
            await self._assign(new)
        for p, (committed, _) in positions.items():
            if self._consumer is not None and self._next.get(p, committed) < committed:
                self._next[p] = committed  # committed past where it got (paused at the cap)
                self._consumer.seek(TopicPartition(self.topic, p), committed)
        await self.read({p: h for p, (_, h) in positions.items()}, timeout_s)
        return {str(p): [[off, k] for off, k in sorted(self._keys.get(p, {}).items())
                         if c <= off < h]
                for p, (c, h) in positions.items() if h > c and self._keys.get(p)}

    async def _assign(self, new: dict[int, int]) -> None:
        if self._consumer is None:
            self._consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                max_partition_fetch_bytes=1 << 20, fetch_max_wait_ms=100)
            await self._consumer.start()
        self._next.update(new)
        # `assign` resets every partition's position: seek each to where the tail is.
        self._consumer.assign([TopicPartition(self.topic, p) for p in self._next])
        for p, off in self._next.items():
            self._consumer.seek(TopicPartition(self.topic, p), off)

    async def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        self._keys, self._next = {}, {}
        if consumer is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await consumer.stop()


def candidates(positions: dict[str, list[int]], keys: dict[str, list[Any]]
               ) -> tuple[list[str], int, int]:
    """(ids to look up, records known by count only, acknowledged not committed) from the
    last read of one topic (pure). `positions`: partition → [committed, highwater]."""
    ids: list[str] = []
    counted = acknowledged = 0
    for p, (committed, high) in positions.items():
        behind = max(0, high - committed)
        acknowledged += behind
        named = [k for off, k in keys.get(p, []) if committed <= off < high]
        ids += [k for k in named if k is not None]
        counted += behind - len(named) + sum(1 for k in named if k is None)
    return ids, counted, acknowledged


async def stored_of(db_url: str, ids: list[str]) -> set[str]:
    """Which of `ids` Postgres holds (a trajectory row, or a dead letter with that key)."""
    if not ids:
        return set()
    engine = make_engine(db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(_STORED, {"uuids": [u for u in ids if _is_uuid(u)],
                                                "keys": [i.encode() for i in ids]})
            return {str(r[0]) for r in rows}
    finally:
        await engine.dispose()


async def count_loss(db_url: str, state: dict[str, Any], now: float | None = None
                     ) -> dict[str, Any]:
    """A lost broker instance's loss from its last read (`state`, see `recovery.record`):
    per topic, acknowledged (not yet committed at the read), not_stored, and the ids still
    missing (re-checked by `recount` while producers re-send). With no read of the instance
    (`stored_positions` absent) nothing is known: `not_stored` is None."""
    topics: dict[str, Any] = {}
    for topic, positions in (state.get("stored_positions") or {}).items():
        ids, counted, acknowledged = candidates(positions,
                                                (state.get("unstored") or {}).get(topic) or {})
        missing = sorted(set(ids) - await stored_of(db_url, ids))
        topics[topic] = {"acknowledged_unstored_at_read": acknowledged, "counted": counted,
                         "missing_ids": missing, "not_stored": counted + len(missing)}
    at = now or time.time()
    known = state.get("stored_positions") is not None
    return {"id": uuid.uuid4().hex[:12], "lost_at": at,
            "broker_started_at": state.get("started_at"),
            "last_read_at": state.get("lag_read_at"), "topics": topics,
            "not_stored": sum(t["not_stored"] for t in topics.values()) if known else None}


class Losses:
    """`<home>/losses.json` (written by the supervisor) minus what an operator acknowledged
    (`<home>/losses-acked.json`, written by `flywheel losses ack`)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.entries: list[dict[str, Any]] = _read(home / LOSSES_FILE) or []

    def add(self, loss: dict[str, Any]) -> None:
        self.entries.append(loss)
        self.save()

    def open(self) -> list[dict[str, Any]]:
        """Losses no operator acknowledged yet, without their id lists (for the status)."""
        acked = set(_read(self.home / ACKED_FILE) or [])
        return [{**e, "topics": {t: {k: v for k, v in d.items() if k != "missing_ids"}
                                 for t, d in e["topics"].items()}}
                for e in self.entries if e["id"] not in acked]

    async def recount(self, db_url: str) -> bool:
        """Drop from each open loss the ids stored since (a producer re-sent them); True
        when a count changed."""
        acked = set(_read(self.home / ACKED_FILE) or [])
        changed = False
        for entry in self.entries:
            if entry["id"] in acked or entry.get("not_stored") is None:
                continue  # acknowledged, or not known: nothing to take off
            for topic in entry["topics"].values():
                missing = topic["missing_ids"]
                if not missing:
                    continue
                left = sorted(set(missing) - await stored_of(db_url, missing))
                if len(left) != len(missing):
                    topic["missing_ids"], changed = left, True
                    topic["not_stored"] = topic["counted"] + len(left)
            entry["not_stored"] = sum(t["not_stored"] for t in entry["topics"].values())
        if changed:
            self.save()
        return changed

    def save(self) -> None:
        _write(self.home / LOSSES_FILE, self.entries)


def acknowledge(home: Path, loss_id: str | None) -> list[str]:
    """Mark one loss (or, with None, every open one) acknowledged; returns the ids marked."""
    acked = list(_read(home / ACKED_FILE) or [])
    open_ids = [e["id"] for e in Losses(home).entries if e["id"] not in acked]
    marked = open_ids if loss_id is None else [i for i in open_ids if i == loss_id]
    if loss_id is not None and not marked:
        raise LookupError(f"no open loss {loss_id!r} (open: {', '.join(open_ids) or 'none'})")
    _write(home / ACKED_FILE, acked + marked)
    return marked


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def storing_groups(settings: Settings) -> dict[str, str]:
    """Per topic whose records exist nowhere else, the group that stores them."""
    topics = settings.topics
    return {topics.trajectories: settings.ingest.group_id,
            topics.feedback: settings.miner.feedback_group_id}


async def loss_view(bootstrap: str, settings: Settings,
                    positions: dict[str, Positions], tail: KeyTail | None = None
                    ) -> dict[str, Any]:
    """What a lost instance's loss is counted from, out of one read of every group's
    positions: per topic the storing group's [committed, highwater] per partition, and the
    keys of the trajectories not committed yet (read while the broker lives: by `tail`, the
    instance's running read of the trajectories' keys, else read afresh)."""
    stored: dict[str, dict[str, list[int]]] = {}
    for topic, group in storing_groups(settings).items():
        stored[topic] = {str(p): [c, h] for p, (c, h) in (positions.get(group) or {}).items()}
    traj = settings.topics.trajectories
    parts = positions.get(settings.ingest.group_id) or {}
    try:
        keys = {traj: await (tail.keys(parts) if tail is not None else
                             unstored(bootstrap, traj, parts))}
    except Exception:  # the broker stopped answering: counted by offsets
        keys = {}
    except asyncio.CancelledError:  # aiokafka's stop leaking its fetcher's cancellation
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        keys = {}
    return {"stored_positions": stored, "unstored": keys}


def with_earlier_keys(state: dict[str, Any], view: dict[str, Any]) -> dict[str, Any]:
    """`view` with the keys its read did not reach taken from the instance's earlier reads
    (`state`, same broker instance) (pure). A key read that fails (the broker stopped
    answering mid-read: the read in flight when it is killed) or runs out of time would
    otherwise leave the last view counting by offsets only, which counts as lost the records
    ingest stored and had not committed yet. A record's key at an offset never changes
    within an instance, so an earlier read's keys in [committed, highwater) still name
    them."""
    earlier = state.get("unstored") or {}
    keys = dict(view.get("unstored") or {})
    for topic, parts in (view.get("stored_positions") or {}).items():
        merged: dict[str, list[Any]] = {}
        for p, (committed, high) in parts.items():
            by_offset = {off: key for off, key in (earlier.get(topic) or {}).get(p, [])
                         if committed <= off < high}
            by_offset.update({off: key for off, key in (keys.get(topic) or {}).get(p, [])})
            if by_offset:
                merged[p] = [[off, by_offset[off]] for off in sorted(by_offset)]
        if merged or topic in keys:
            keys[topic] = merged
    return {**view, "unstored": keys}


def arrived(before: dict[str, Any], after: dict[str, Any]) -> int:
    """Records that reached the stored topics between two views (pure)."""
    total = 0
    for topic, parts in (after.get("stored_positions") or {}).items():
        old = (before.get("stored_positions") or {}).get(topic) or {}
        total += sum(max(0, h - (old.get(p) or [0, 0])[1]) for p, (_, h) in parts.items())
    return total


def unstored_total(view: dict[str, Any]) -> int:
    return sum(max(0, h - c) for parts in (view.get("stored_positions") or {}).values()
               for c, h in parts.values())
