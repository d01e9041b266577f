"""Rollout scheduler: keeps rollout workers supplied with the most useful tasks.

Reads:      `tasks`, `task_stats`, `rollout_requests`, `rollout_groups` (backlog),
            `adapter_versions` (the newest version is sampled).
Writes:     `rollout_requests`, `validation_tasks`, `validation_status` (a pause ends),
            `events` + `outbox`.
Publishes (through the outbox): `RolloutRequested` → `<prefix>.rollout.requests`.

It tops up requests so that outstanding requests plus the untrained backlog stay within
max_staleness × B groups: sampling never runs further ahead of training than that. While
the trainer's warm start is under way (waiting for the baseline, or SFT) it requests
nothing: those groups would come from a policy about to be replaced. Before picking, it
tops up the validation split (`flywheel.validation.split`: tasks never sampled for
training), and it never picks a validation task; while the validation pass reports
overfitting it requests nothing until the miner adds tasks.
"""

from __future__ import annotations

import asyncio
import logging
import random

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from flywheel.adapters import registry
from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.errors import describe, is_transient
from flywheel.rollout import store
from flywheel.rollout.select import pick_tasks
from flywheel.runtime.consume import RetryPolicy
from flywheel.runtime.endpoints import resolve_db_url
from flywheel.runtime.entrypoint import pause, run_loop
from flywheel.trainer.store import trainer_state
from flywheel.validation import split as validation_split
from flywheel.validation import store as validation_store

log = logging.getLogger("flywheel.scheduler")


async def schedule_once(engine: AsyncEngine, settings: Settings, rng: random.Random) -> int:
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
        # First, even while nothing is requested: the SFT warm start must not learn from
        # a task that validation will judge it on (its demonstrations skip them).
        added = await validation_split.assign(conn, settings.validation, cfg.envs)
        if added:
            log.info("set aside %d more tasks for validation", added)
        room = budget - await store.backlog(conn) - await store.outstanding(conn)
        if room <= 0:
            return 0
        version = await registry.newest_version(conn, settings.policy)
        if version is None and await _warm_starting(conn, settings):
            return 0
        if await validation_store.paused(conn, settings.policy,
                                         settings.validation.resume_new_tasks):
            return 0  # overfitting: more tasks, not more steps (docs/VALIDATION.md)
        picked = pick_tasks(await store.candidate_stats(conn, cfg.envs), room, rng,
                            explore_share=cfg.explore_share, min_attempts=cfg.group_size)
        await store.request_rollouts(conn, picked, version, settings.topics)
    return len(picked)


async def _warm_starting(conn: AsyncConnection, settings: Settings) -> bool:
    """Baseline first: until the trainer's first stage is settled (the baseline is measured
    and, if it says SFT, the SFT version published), groups sampled from the base model
    would only be superseded — don't sample them. A trainer that gave up waiting (no
    baseline, no demonstrations) goes on with GRPO, and so does sampling."""
    if settings.trainer.stages != "sft_then_grpo":
        return False
    policy = settings.policy
    state = await trainer_state(conn, policy)
    if state in ("waiting", "training", "starved", "stalled"):
        return False
    baseline = await registry.latest_baseline(conn, policy)
    return baseline is None or baseline["recommendation"] == "sft"


async def run_scheduler(settings: Settings, stop: asyncio.Event) -> None:
    engine = make_engine(resolve_db_url(settings), pool_size=1)
    rng = random.Random()
    retry, failures = RetryPolicy.of(settings.retry), 0
    try:
        while not stop.is_set():
            try:
                issued = await schedule_once(engine, settings, rng)
            except Exception as err:
                # Postgres refusing connections (starting, restarting) is waited out, as
                # every other service does; anything else is a bug and propagates.
                if not is_transient(err):
                    raise
                delay, failures = retry.delay(failures), failures + 1
                log.warning("scheduling: transient failure #%d (%s); retrying in %.1fs",
                            failures, describe(err), delay)
                await pause(stop, delay)
                continue
            failures = 0
            if issued:
                log.info("requested %d rollout groups", issued)
            await pause(stop, settings.rollout.scheduler_interval_s)
    finally:
        await engine.dispose()


def main() -> None:
    run_loop(run_scheduler)


if __name__ == "__main__":
    main()
