"""Draining the local stack before its broker stops (`flywheel down`, a broker recycle).

1. Intake closes: the API's gateway answers 503 with Retry-After, and the close returns once
   every request it had admitted has published (`POST /v1/intake`).
2. The scheduler stops, so no new rollout work is created.
3. Wait, bounded by `stack.drain_timeout_s`, until the trajectory consumers (ingest, miner)
   have consumed everything and the outbox is empty: those trajectories exist nowhere else.
4. Then wait up to `stack.drain_recoverable_s` more for the consumers of outbox-fed topics
   (rollout workers, trainer, gate). What they leave is still in the outbox and is
   republished at the next start (`flywheel.stack.recovery`), so it is not lost either;
   the trainer holds its groups uncommitted until it publishes a version, by design.

SDK clients talk to the broker directly and keep publishing until it stops; they hold what
the broker acknowledged until it is stored (`producers.confirm`) and send it again to the
next broker, so nothing they were told is delivered is lost. After this drain the stack
stops the other services and keeps ingest and the miner for a last settle
(`Stack._settle`): "drained" only when nothing is left to store and nothing arrived for a
second; else what the last read saw unstored is counted as a loss (`losses`).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import text

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.runtime.kafka import consumer_groups, group_positions

_PENDING = text("SELECT count(*) FROM outbox WHERE published_at IS NULL AND error IS NULL")
READ_TIMEOUT_S = 5.0


@dataclass
class DrainReport:
    done: bool = False
    """Everything consumed and the outbox empty."""
    trajectories_drained: bool = False
    """Ingest and the miner consumed every trajectory (the part nothing else can recover)."""
    intake_closed: bool = False
    waited_s: float = 0.0
    lag: dict[str, int] = field(default_factory=dict)
    outbox_pending: int | None = None
    notes: list[str] = field(default_factory=list)
    trajectory_groups: tuple[str, ...] = ()
    """The groups whose backlog exists only in the broker (ingest, the miner)."""
    read_at: float | None = None
    """Wall-clock start of the last lag read that answered (what `lag` describes)."""
    positions: Positions = field(default_factory=dict)
    """That read's committed offsets and highwaters (what a later recovery starts from)."""

    def summary(self) -> str:
        """What happened, in words (printed by `flywheel down`)."""
        if self.done:
            return f"drained in {self.waited_s:.0f}s: every consumer caught up, outbox empty"
        parts = [f"drain stopped after {self.waited_s:.0f}s"]
        left = {g: n for g, n in self.lag.items() if n}
        if not self.trajectories_drained:
            behind = [f"{g} {n} behind" for g, n in left.items() if g in self.trajectory_groups]
            parts.append("NOT all trajectories were consumed (" + (", ".join(behind) or
                         "the broker did not answer") + "): those records are lost with the "
                         "broker's memory")
        recoverable = {g: n for g, n in left.items() if g not in self.trajectory_groups}
        if recoverable:
            parts.append("not consumed yet (republished from the outbox at the next start, "
                         "not lost): " + ", ".join(f"{g} {n}" for g, n in recoverable.items()))
        if self.outbox_pending:
            parts.append(f"{self.outbox_pending} outbox rows unpublished (kept in Postgres, "
                         "published at the next start)")
        return "; ".join(parts + self.notes)


def progress_line(lag: dict[str, int], outbox: int | None, left_s: float) -> str:
    """`draining: flywheel-ingest 1200 · flywheel-miner 30 · outbox 4 (87s left)` (pure)."""
    behind = " · ".join(f"{g} {n}" for g, n in lag.items() if n) or "consumers caught up"
    box = "outbox ?" if outbox is None else f"outbox {outbox}"
    return f"draining: {behind} · {box} ({left_s:.0f}s left)"


def close_intake(api_url: str, token: str | None, wait_s: float = 15.0) -> str | None:
    """Close the gateway's intake; None when done, else why not (said in the report)."""
    if token is None:
        return "no operate token known: intake not closed"
    req = urllib.request.Request(
        api_url + "/v1/intake", method="POST",
        data=json.dumps({"open": False, "wait_s": wait_s}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=wait_s + 5) as r:
            body = json.loads(r.read() or b"{}")
    except (OSError, ValueError) as err:
        return f"the API did not close intake ({err})"
    if not body.get("settled", True):
        return f"{body.get('in_flight')} gateway requests were still publishing after {wait_s}s"
    return None


def reopen_intake(api_url: str, token: str | None) -> None:
    if token is None:
        return
    req = urllib.request.Request(
        api_url + "/v1/intake", method="POST", data=b'{"open": true}',
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10):
            pass
    except (urllib.error.URLError, OSError):
        pass  # a restarted API opens with intake open anyway


Positions = dict[str, dict[int, tuple[int, int]]]
"""Per group, per partition: (committed offset, highwater)."""


async def read_positions(bootstrap: str, groups: list[tuple[str, str]]) -> Positions | None:
    """Every group's positions, None when the broker does not answer."""
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            found = await asyncio.gather(*(group_positions(bootstrap, g, t) for g, t in groups))
    except Exception:
        return None
    except asyncio.CancelledError:
        # aiokafka's `consumer.stop` lets its fetcher's own cancellation out when the broker
        # dies mid-read; that ended the stack's watch thread (no read of any later instance:
        # losses unknown). Only a cancellation of this task is passed on.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        return None
    return {g: parts for (g, _), parts in zip(groups, found, strict=True)}


def totals(positions: Positions) -> dict[str, int]:
    """Total lag per group (pure)."""
    return {g: sum(max(0, high - done) for done, high in parts.values())
            for g, parts in positions.items()}


async def read_lag(bootstrap: str, groups: list[tuple[str, str]]) -> dict[str, int] | None:
    """Total lag per group, None when the broker does not answer."""
    positions = await read_positions(bootstrap, groups)
    return None if positions is None else totals(positions)


async def read_outbox(db_url: str) -> int | None:
    engine = make_engine(db_url, pool_size=1)
    try:
        async with asyncio.timeout(READ_TIMEOUT_S), engine.connect() as conn:
            return int((await conn.execute(_PENDING)).scalar_one())
    except Exception:
        return None
    finally:
        await engine.dispose()


async def drain(settings: Settings, *, tick: Callable[[], None],
                progress: Callable[[str], None], timeout_s: float | None = None,
                recoverable_s: float | None = None) -> DrainReport:
    """Wait for the consumers and the relay as described in the module docstring. Intake
    and the scheduler are the caller's to stop first; `tick` keeps the stack healthy
    while waiting (a consumer that dies meanwhile is restarted)."""
    assert settings.kafka.bootstrap and settings.db.url
    cfg = settings.stack
    timeout_s = cfg.drain_timeout_s if timeout_s is None else timeout_s
    recoverable_s = cfg.drain_recoverable_s if recoverable_s is None else recoverable_s
    groups = consumer_groups(settings)
    must = tuple(g for g, t in groups if t == settings.topics.trajectories)
    report = DrainReport(trajectory_groups=must)
    start = time.monotonic()
    must_done_at: float | None = None
    silent = 0
    while True:
        tick()
        read_at = time.time()
        positions, outbox = await asyncio.gather(
            read_positions(settings.kafka.bootstrap, groups), read_outbox(settings.db.url))
        lag = None if positions is None else totals(positions)
        now = time.monotonic()
        report.waited_s = now - start
        if lag is not None and positions is not None:
            report.lag, report.read_at, report.positions, silent = lag, read_at, positions, 0
        else:
            silent += 1
            if silent >= 3:
                report.notes.append("the broker does not answer: there was nothing left to "
                                    "drain from it")
                return report
        report.outbox_pending = outbox
        if lag is not None and outbox == 0 and all(lag[g] == 0 for g in must):
            report.trajectories_drained = True
            must_done_at = must_done_at or now
            if all(n == 0 for n in lag.values()):
                report.done = True
                return report
            if now - must_done_at >= recoverable_s:
                return report
        else:
            report.trajectories_drained = lag is not None and all(lag[g] == 0 for g in must)
        if report.waited_s >= timeout_s:
            return report
        progress(progress_line(report.lag, outbox, timeout_s - report.waited_s))
        await asyncio.sleep(1.0)
