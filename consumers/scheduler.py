"""Rollout scheduler: keeps rollout workers supplied with the most useful tasks (wiring; the
policy is `flywheel.rollout.schedule`).

Subscribes: nothing (a polling loop every `rollout.scheduler_interval_s`, one scheduler at a
            time by a Postgres advisory lock).
Reads:      `tasks`, `task_stats`, `rollout_requests`, `rollout_groups` (backlog),
            `adapter_versions` (the newest version is sampled), `trainer_status`, `baselines`,
            `gate_status`.
Writes:     `rollout_requests`, `validation_tasks`, `validation_status` (a pause ends),
            `events` + `outbox`.
Publishes (through the outbox): `RolloutRequested` → `<prefix>.rollout.requests`.

Here the other roles' holds on sampling are bound (the validation split,
`flywheel.validation.split`; the trainer's warm start, `flywheel.trainer.warm_start`; the
overfitting pause, `flywheel.validation.store`; the gate's activity,
`flywheel.adapters.registry.gate_evaluating`, for `rollout.yield_to_gate`), and outages are
waited out.
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
from flywheel.rollout import schedule
from flywheel.runtime.consume import RetryPolicy
from flywheel.runtime.endpoints import resolve_db_url
from flywheel.runtime.entrypoint import pause, run_loop
from flywheel.trainer.warm_start import warm_starting
from flywheel.validation import split as validation_split
from flywheel.validation import store as validation_store

log = logging.getLogger("flywheel.scheduler")


def holds(settings: Settings) -> schedule.Holds:
    """The trainer's and the validation pass's say on sampling, bound to `settings`."""
    async def set_aside(conn: AsyncConnection) -> int:
        return await validation_split.assign(conn, settings.validation, settings.rollout.envs)

    async def warm(conn: AsyncConnection) -> bool:
        return await warm_starting(conn, settings)

    async def paused(conn: AsyncConnection) -> bool:
        return await validation_store.paused(conn, settings.policy,
                                             settings.validation.resume_new_tasks)

    async def gate_busy(conn: AsyncConnection) -> bool:
        return await registry.gate_evaluating(conn, settings.policy) is not None

    return schedule.Holds(set_aside=set_aside, warm_starting=warm, paused=paused,
                          gate_busy=gate_busy)


async def schedule_once(engine: AsyncEngine, settings: Settings, rng: random.Random) -> int:
    """One scheduling round with the holds wired in; returns how many groups it requested."""
    return await schedule.schedule_once(engine, settings, rng, holds(settings))


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
