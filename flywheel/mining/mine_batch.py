"""One mining step over a batch of trajectories, inside the caller's transaction.

Successes are recorded first (by session and request), so that a failure in the same batch
finds its later retry; a success also upgrades earlier unverifiable failures of the same
request in its session. A trajectory with no outcome yet is not mined: feedback brings its
outcome later, and `remine` mines it then (`mining.outcomes`).

A failed multi-step trajectory on a registered toolset becomes an episode task
(`mining.episodes`; the toolsets are read once per batch); one that cannot be verified as
an episode is counted by reason (`MineStats.episode_unverifiable`) and mined as a single
step.

Both paths serialize on one advisory lock per trajectory: its (session, request) when it has
both, else its id. The batch path mines a record as it came off the topic, so it steps back
for a trajectory whose feedback was applied first (the store's `as_ingested` guards);
`remine` always mines the trajectory with its feedback applied and replaces what the batch
path stored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.config import Topics
from flywheel.mining import store
from flywheel.mining.build import Unverifiable, build_task, expected_calls, request_key
from flywheel.mining.classify import Classification, Labeller, classify_failure
from flywheel.mining.episodes import build_episode
from flywheel.mining.expected import same_episode
from flywheel.tasks import TaskSpec
from flywheel.tools.descriptors import Registration
from flywheel.tools.registry import registrations
from flywheel.trajectory import Trajectory

Claim = Literal["claim", "upgrade", "refresh"]


@dataclass
class MineStats:
    failures: int = 0
    tasks_created: int = 0
    tasks_joined: int = 0
    unverifiable: int = 0
    upgraded: int = 0
    redelivered: int = 0
    awaiting: int = 0
    episodes: int = 0
    """Failures that became (or joined) an episode task."""
    modes: Counter[str] = field(default_factory=Counter)
    episode_unverifiable: Counter[str] = field(default_factory=Counter)
    """Episode candidates that could not be verified, by reason (they fall back to the
    single-step task, when that can be built)."""

    def add(self, other: MineStats) -> None:
        for name in ("failures", "tasks_created", "tasks_joined", "unverifiable", "upgraded",
                     "redelivered", "awaiting", "episodes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.modes.update(other.modes)
        self.episode_unverifiable.update(other.episode_unverifiable)


def _build(t: Trajectory, c: Classification, retry: Trajectory | None,
           toolsets: Sequence[Registration], stats: MineStats, holdout_fraction: float,
           count: bool) -> TaskSpec | Unverifiable:
    """The episode task when `t` is one (`mining.episodes`), else the single-step task."""
    episode = build_episode(t, c, toolsets, retry=retry, holdout_fraction=holdout_fraction) \
        if toolsets else None
    if isinstance(episode, TaskSpec):
        stats.episodes += 1
        return episode
    if isinstance(episode, Unverifiable) and count:
        stats.episode_unverifiable[episode.reason] += 1
    return build_task(t, c, retry=retry, holdout_fraction=holdout_fraction)


async def _task_for(conn: AsyncConnection, t: Trajectory, retry: Trajectory | None,
                    stats: MineStats, *, holdout_fraction: float, topics: Topics,
                    labeller: Labeller | None, claim: Claim,
                    toolsets: Sequence[Registration] = ()) -> bool:
    """Classify and build; returns True when it became (or joined) a task. `claim`: insert
    the failure if new (`claim`), settle an existing one (`upgrade`), or replace what was
    stored with this version of the trajectory (`refresh`)."""
    found = expected_calls(t, retry)
    c = classify_failure(t, found[0] if found else None, labeller)
    key = request_key(t)
    if claim == "claim" and not await store.claim_failure(conn, t, key, c):
        stats.redelivered += 1
        return False
    if claim == "claim" or (claim == "refresh"
                            and await store.claim_failure(conn, t, key, c, refresh=True)):
        stats.failures += 1
        stats.modes[c.mode] += 1
    result = _build(t, c, retry, toolsets, stats, holdout_fraction, claim != "upgrade")
    await store.settle_failure(conn, t.trajectory_id, result,
                               None if claim == "claim" else c.mode)
    if isinstance(result, Unverifiable):
        stats.unverifiable += claim != "upgrade"
        return False
    source = found[1] if found else "tests"
    if await store.store_task(conn, result, t.trajectory_id, source, topics):
        stats.tasks_created += 1
    else:
        stats.tasks_joined += 1
    return True


async def lock_trajectory(conn: AsyncConnection, t: Trajectory) -> None:
    """Serialize the mining of one trajectory (and of its session's request) across
    miners: a failure and its retry may be mined at the same moment by two members (they
    live on different partitions), or a record and its feedback."""
    key = request_key(t)
    lock = f"{t.session_id}:{key}" if t.session_id is not None and key is not None \
        else f":{t.trajectory_id}"
    await conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": lock})


async def _retry(conn: AsyncConnection, t: Trajectory) -> Trajectory | None:
    """The newest success of the same request in the session that is not `t`'s own
    conversation going on (a later call of it is no retry)."""
    key = request_key(t)
    if t.session_id is None or key is None:
        return None
    for success in await store.find_successes(conn, t.session_id, key):
        if success.trajectory_id != t.trajectory_id and not same_episode(t, success):
            return success
    return None


async def _success(conn: AsyncConnection, t: Trajectory, stats: MineStats, *,
                   holdout_fraction: float, topics: Topics, labeller: Labeller | None,
                   as_ingested: bool, toolsets: Sequence[Registration] = ()) -> None:
    """Record a success of a session's request; it upgrades earlier unverifiable failures."""
    key = request_key(t)
    assert t.session_id is not None and key is not None
    await store.record_success(conn, t, key, as_ingested=as_ingested)
    for failed, _mode in await store.unverified_failures(conn, t.session_id, key):
        if await _task_for(conn, failed, t, stats, holdout_fraction=holdout_fraction,
                           topics=topics, labeller=labeller, claim="upgrade",
                           toolsets=toolsets):
            stats.upgraded += 1


async def mine_batch(conn: AsyncConnection, batch: list[Trajectory], *, holdout_fraction: float,
                     topics: Topics, labeller: Labeller | None = None) -> MineStats:
    """Mine a batch in the caller's transaction. Errors propagate: the caller retries what
    is transient and narrows anything else down to the trajectory that fails, which is
    parked (`flywheel.runtime.consume.settle`), never skipped in silence."""
    stats = MineStats()
    stats.awaiting = sum(t.outcome is None for t in batch)
    toolsets = await registrations(conn)
    for t in batch:
        if not t.is_success or t.session_id is None or request_key(t) is None:
            continue
        await lock_trajectory(conn, t)
        await _success(conn, t, stats, holdout_fraction=holdout_fraction, topics=topics,
                       labeller=labeller, as_ingested=True, toolsets=toolsets)
    for t in batch:
        if not t.is_failure:
            continue
        await lock_trajectory(conn, t)
        await _task_for(conn, t, await _retry(conn, t), stats,
                        holdout_fraction=holdout_fraction, topics=topics, labeller=labeller,
                        claim="claim", toolsets=toolsets)
    return stats


async def remine(conn: AsyncConnection, t: Trajectory, *, holdout_fraction: float,
                 topics: Topics, labeller: Labeller | None = None) -> MineStats:
    """Mine `t` again with its feedback applied, replacing what an earlier mining of it
    stored (a success that feedback turned into a failure is no retry any more; a failure
    it turned into a success is overturned). The caller holds `lock_trajectory`."""
    stats = MineStats()
    if t.outcome is None:
        stats.awaiting = 1
        return stats
    toolsets = await registrations(conn)
    if t.is_failure:
        await store.forget_success(conn, t.trajectory_id)
        await _task_for(conn, t, await _retry(conn, t), stats,
                        holdout_fraction=holdout_fraction, topics=topics, labeller=labeller,
                        claim="refresh", toolsets=toolsets)
        return stats
    await store.overturn_failure(conn, t.trajectory_id)
    if t.session_id is not None and request_key(t) is not None:
        await _success(conn, t, stats, holdout_fraction=holdout_fraction, topics=topics,
                       labeller=labeller, as_ingested=False, toolsets=toolsets)
    return stats
