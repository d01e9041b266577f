"""The gate's status row: what it is doing, how far it got, and what the eval set can see.

`flywheel status`, `/metrics`, the dashboard and the trainer's wait for the baseline read
it (`flywheel.adapters.registry.gate_activity`). While the gate works, a heartbeat keeps
`updated_at` fresh even inside a long round, so a stopped gate reads as stale, not busy, and
writes the samples done so far, counted task by task, so progress moves within a round.
Writes commit on their own (short transactions): progress is not part of any decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from flywheel.adapters import registry
from flywheel.config import Settings
from flywheel.events import GatePower
from flywheel.gate import power
from flywheel.gate.evaluate import Holdout, production_samples

log = logging.getLogger("flywheel.gate")
HEARTBEAT_S = 5.0


async def write_status(conn: AsyncConnection, policy: str, *, state: str,
                       version: int | None = None, baseline_version: int | None = None,
                       eval_set_version: int | None = None, rounds_planned: int = 0,
                       samples_planned: int = 0, detail: str | None = None) -> None:
    """Start (or end, `state = idle`) an activity; keeps the power record."""
    await conn.execute(text("""
        INSERT INTO gate_status (policy, state, version, baseline_version, eval_set_version,
            round, rounds_planned, samples_done, samples_planned, started_at, updated_at,
            detail)
        VALUES (:p, :s, :v, :b, :e, 0, :rp, 0, :sp,
                CASE WHEN :s = 'idle' THEN NULL ELSE now() END, now(), :d)
        ON CONFLICT (policy) DO UPDATE SET state = :s, version = :v, baseline_version = :b,
            eval_set_version = :e, round = 0, rounds_planned = :rp, samples_done = 0,
            samples_planned = :sp,
            started_at = CASE WHEN :s = 'idle' THEN NULL ELSE now() END,
            updated_at = now(), detail = :d"""),
        {"p": policy, "s": state, "v": version, "b": baseline_version, "e": eval_set_version,
         "rp": rounds_planned, "sp": samples_planned, "d": detail})


async def write_round(conn: AsyncConnection, policy: str, *, round_: int, samples_done: int,
                      detail: str | None) -> None:
    await conn.execute(text("""UPDATE gate_status SET round = :r, samples_done = :n,
        detail = :d, updated_at = now() WHERE policy = :p"""),
        {"p": policy, "r": round_, "n": samples_done, "d": detail})


async def write_power(conn: AsyncConnection, policy: str, power: GatePower) -> None:
    """The newest eval set's power record (and its warning) for status and metrics."""
    await conn.execute(text("""
        INSERT INTO gate_status (policy, state, updated_at, power)
        VALUES (:p, 'idle', now(), CAST(:w AS jsonb))
        ON CONFLICT (policy) DO UPDATE SET power = CAST(:w AS jsonb)"""),
        {"p": policy, "w": power.model_dump_json()})


async def eval_set_power(conn: AsyncConnection, settings: Settings, holdout: Holdout
                         ) -> GatePower:
    """What `holdout` can see at the gate's budget, from production's cached samples on it
    — or, before it has any there, on the newest eval set it has some (a property of the
    model more than of the tasks) — else from the assumed bound."""
    production = await registry.production_version(conn, settings.policy)
    found = await production_samples(conn, settings.policy, production,
                                     holdout.eval_set_version) \
        or await production_samples(conn, settings.policy, production)
    pd = success = None
    source = ""
    if found is not None:
        by_task, source = found
        pd = power.between_sample_discordance(by_task.values())
        flat = [x for v in by_task.values() for x in v]
        success = sum(flat) / len(flat) if flat else None
    return power.report(settings.gate, tasks=len(holdout.tasks), discordance=pd,
                        source=source, production_success=success)


class Progress:
    """One activity of the gate, reported in `gate_status` while it runs."""

    def __init__(self, engine: AsyncEngine, policy: str) -> None:
        self.engine, self.policy = engine, policy
        self.samples = 0
        """Samples done in the current activity, task by task (the heartbeat writes it)."""

    def task_done(self, samples: int) -> None:
        """One task's group (of `samples`) is done: counted now, written with the next beat."""
        self.samples += samples

    @contextlib.asynccontextmanager
    async def activity(self, state: str, **fields: Any) -> AsyncIterator[Progress]:
        self.samples = 0
        async with self.engine.begin() as conn:
            await write_status(conn, self.policy, state=state, **fields)
        beat = asyncio.create_task(self._beat())
        try:
            yield self
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            with contextlib.suppress(Exception):  # reporting must not mask the real error
                async with self.engine.begin() as conn:
                    await write_status(conn, self.policy, state="idle")

    async def round_done(self, round_: int, detail: str | None) -> None:
        async with self.engine.begin() as conn:
            await write_round(conn, self.policy, round_=round_, samples_done=self.samples,
                              detail=detail)

    async def power(self, power: GatePower) -> None:
        async with self.engine.begin() as conn:
            await write_power(conn, self.policy, power)
        if power.warning:
            log.warning("eval set: %s", power.warning)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                async with self.engine.begin() as conn:
                    await conn.execute(text("""UPDATE gate_status SET updated_at = now(),
                        samples_done = GREATEST(samples_done, :n) WHERE policy = :p"""),
                        {"p": self.policy, "n": self.samples})
            except Exception as err:  # a missed heartbeat must not stop the evaluation
                log.warning("gate heartbeat failed: %s", err)
