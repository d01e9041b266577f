"""One mining step over a batch of trajectories, inside the caller's transaction.

Successes are recorded first (by session and request), so that a failure in the same batch
finds its later retry; a success also upgrades earlier unverifiable failures of the same
request in its session.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.config import Topics
from flywheel.mining import store
from flywheel.mining.build import Unverifiable, build_task, expected_calls, request_key
from flywheel.mining.classify import Labeller, classify_failure
from flywheel.schemas import Trajectory


@dataclass
class MineStats:
    failures: int = 0
    tasks_created: int = 0
    tasks_joined: int = 0
    unverifiable: int = 0
    upgraded: int = 0
    redelivered: int = 0
    modes: Counter[str] = field(default_factory=Counter)


async def _task_for(conn: AsyncConnection, t: Trajectory, retry: Trajectory | None,
                    stats: MineStats, *, holdout_fraction: float, topics: Topics,
                    labeller: Labeller | None, claim: bool) -> bool:
    """Classify and build; returns True when it became (or joined) a task."""
    found = expected_calls(t, retry)
    c = classify_failure(t, found[0] if found else None, labeller)
    key = request_key(t)
    if claim:
        if not await store.claim_failure(conn, t, key, c):
            stats.redelivered += 1
            return False
        stats.failures += 1
        stats.modes[c.mode] += 1
    result = build_task(t, c, retry=retry, holdout_fraction=holdout_fraction)
    await store.settle_failure(conn, t.trajectory_id, result, None if claim else c.mode)
    if isinstance(result, Unverifiable):
        stats.unverifiable += claim
        return False
    source = found[1] if found else "tests"
    if await store.store_task(conn, result, t.trajectory_id, source, topics):
        stats.tasks_created += 1
    else:
        stats.tasks_joined += 1
    return True


async def _lock_request(conn: AsyncConnection, session_id: str, key: str) -> None:
    """Serialize a session's request across miners: a failure and its retry may be mined at
    the same moment by two members (they live on different partitions)."""
    await conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"),
                       {"k": f"{session_id}:{key}"})


async def mine_batch(conn: AsyncConnection, batch: list[Trajectory], *, holdout_fraction: float,
                     topics: Topics, labeller: Labeller | None = None) -> MineStats:
    """Mine a batch in the caller's transaction. Errors propagate: the caller retries what
    is transient and narrows anything else down to the trajectory that fails, which is
    parked (`flywheel.runtime.consume.settle`), never skipped in silence."""
    stats = MineStats()
    for t in batch:
        if t.is_failure or t.session_id is None:
            continue
        key = request_key(t)
        if key is None:
            continue
        await _lock_request(conn, t.session_id, key)
        await store.record_success(conn, t, key)
        for failed, _mode in await store.unverified_failures(conn, t.session_id, key):
            if await _task_for(conn, failed, t, stats, holdout_fraction=holdout_fraction,
                               topics=topics, labeller=labeller, claim=False):
                stats.upgraded += 1
    for t in batch:
        if not t.is_failure:
            continue
        key = request_key(t)
        retry = None
        if t.session_id is not None and key is not None:
            await _lock_request(conn, t.session_id, key)
            retry = await store.find_success(conn, t.session_id, key)
        await _task_for(conn, t, retry, stats, holdout_fraction=holdout_fraction,
                        topics=topics, labeller=labeller, claim=True)
    return stats
