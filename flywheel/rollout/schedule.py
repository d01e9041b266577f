"""Rollout scheduling: keep rollout workers supplied with the most useful tasks, within budget.

The admission budget: outstanding requests plus the untrained backlog stay within
max_staleness × B groups, so sampling never runs further ahead of training than that. The
pick itself is `flywheel.rollout.select`. What other roles say about sampling comes in as
`Holds`, read in the same transaction under the scheduler's lock (rollout imports neither
the trainer nor the validation pass; `consumers.scheduler` binds them): the validation
split is topped up before picking (tasks never sampled for training), nothing is requested
while the trainer's warm start is under way (those groups would come from a policy about to
be replaced), nor while the validation pass reports overfitting (until the miner adds tasks),
nor (`rollout.yield_to_gate`) while the gate evaluates a candidate on the same cores.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from flywheel.adapters import registry
from flywheel.config import Settings
from flywheel.rollout import store
from flywheel.rollout.select import pick_tasks

log = logging.getLogger("flywheel.scheduler")
Check = Callable[[AsyncConnection], Awaitable[bool]]


@dataclass(frozen=True, slots=True)
class Holds:
    """Other roles' say on sampling, each read inside the scheduler's transaction."""

    set_aside: Callable[[AsyncConnection], Awaitable[int]]
    """Top up the validation split first (even while nothing is requested: the SFT warm
    start must not learn from a task validation will judge it on); returns how many."""
    warm_starting: Check
    """With no adapter version yet: is the trainer's first stage still being settled?"""
    paused: Check
    """Is sampling paused for overfitting (more tasks, not more steps)?"""
    gate_busy: Check
    """Is the gate evaluating a candidate, with a live heartbeat?"""


async def schedule_once(engine: AsyncEngine, settings: Settings, rng: random.Random,
                        holds: Holds) -> int:
    """Issue as many requests as the admission budget allows; returns how many."""
    cfg = settings.rollout
    budget = cfg.max_staleness * cfg.train_batch_groups
    async with engine.begin() as conn:
        await store.lock_scheduler(conn)
        # A request unanswered for long (its message lost with a memory-only broker, or a
        # worker that keeps failing) must not hold budget or its task forever.
        expired = await store.expire_requests(conn, older_than_s=3 * cfg.rollout_timeout_s)
        if expired:
            log.warning("expired %d unanswered rollout requests", expired)
        added = await holds.set_aside(conn)
        if added:
            log.info("set aside %d more tasks for validation", added)
        outstanding = await store.outstanding(conn)
        room = budget - await store.backlog(conn) - outstanding
        if room <= 0:
            return 0
        version = await registry.newest_version(conn, settings.policy)
        if version is None and await holds.warm_starting(conn):
            return 0
        if await holds.paused(conn):
            return 0  # overfitting: more tasks, not more steps (docs/VALIDATION.md)
        if cfg.yield_to_gate and await holds.gate_busy(conn):
            return 0  # the decision first: the gate has the cores (rollout.yield_to_gate)
        stats = await store.candidate_stats(conn, cfg.envs)
        picked = pick_tasks(stats, room, rng, explore_share=cfg.explore_share,
                            min_attempts=cfg.group_size, group_size=cfg.group_size,
                            min_signal=cfg.min_signal)
        _say_idle(bool(stats) and not picked and not outstanding,
                  len(stats), cfg.min_signal)
        await store.request_rollouts(conn, picked, version, settings.topics)
    return len(picked)


_idle = False


def _say_idle(idle: bool, tasks: int, min_signal: float) -> None:
    """Say once when sampling stops for want of a task worth a group, and when it resumes."""
    global _idle
    if idle and not _idle:
        log.warning("no task worth a group: each of the %d training tasks would be "
                    "trainable with a chance under rollout.min_signal %.2f (always or never "
                    "solved so far); sampling resumes when the miner adds tasks", tasks,
                    min_signal)
    elif _idle and not idle:
        log.info("sampling resumed")
    _idle = idle
