"""One rollout request, end to end, for the worker: load, admit, sample, score, record."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import zlib
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters.resolver import AdapterResolver
from flywheel.config import Settings
from flywheel.environments import load_environment
from flywheel.events import RolloutRequestedPayload
from flywheel.mining.store import HoldoutRefused, training_tasks
from flywheel.policy.base import Policy
from flywheel.rollout import store
from flywheel.rollout.loop import GroupConfig, GroupOutcome, run_group
from flywheel.tasks import TaskSpec

log = logging.getLogger("flywheel.rollout")


def group_config(settings: Settings) -> GroupConfig:
    r = settings.rollout
    return GroupConfig(group_size=r.group_size, max_tokens=r.max_tokens,
                       episode_max_tokens=r.episode_max_tokens, temperature=r.temperature,
                       max_steps=r.max_steps,
                       rollout_timeout_s=r.rollout_timeout_s, min_scored=r.min_scored)


async def wait_for_admission(engine: AsyncEngine, settings: Settings,
                             poll_s: float = 1.0, reserved: int = 0) -> float:
    """Block while the untrained backlog, plus `reserved` groups admitted but not recorded
    yet, is at its bound; returns seconds waited."""
    budget = settings.rollout.max_staleness * settings.rollout.train_batch_groups
    waited = 0.0
    while True:
        async with engine.connect() as conn:
            if await store.backlog(conn) + reserved < budget:
                return waited
        await asyncio.sleep(poll_s)
        waited += poll_s


class Admission:
    """A worker's groups in flight count against the backlog bound from admission until
    they are recorded, so N groups at once never admit more than one at a time would."""

    def __init__(self) -> None:
        self.admitted = 0
        self._lock = asyncio.Lock()  # first come, first admitted

    @contextlib.asynccontextmanager
    async def slot(self, engine: AsyncEngine, settings: Settings) -> AsyncIterator[float]:
        """Admitted (after waiting the seconds it yields) until the block ends."""
        async with self._lock:
            waited = await wait_for_admission(engine, settings, reserved=self.admitted)
            self.admitted += 1
        try:
            yield waited
        finally:
            self.admitted -= 1


async def handle_request(req: RolloutRequestedPayload, *, engine: AsyncEngine, policy: Policy,
                         settings: Settings, worker: str, adapters: AdapterResolver,
                         admission: Admission | None = None) -> GroupOutcome | None:
    """Sample and record the group for `req`; None when there is nothing to do."""
    group_id = req.request_id
    async with engine.begin() as conn:
        if await store.already_scored(conn, group_id):
            return None
        try:
            tasks = await training_tasks(conn, task_ids=[req.task_id], limit=1)
        except HoldoutRefused as err:
            log.error("refusing rollout request %s: %s", group_id, err)
            tasks = []
        if not tasks:
            await mark_failed(conn, group_id)
            return None
    async with (admission or Admission()).slot(engine, settings) as waited:
        if waited:
            log.info("admission: waited %.0fs for the trainer to drain the backlog", waited)
        return await _sample_and_record(req, tasks[0], engine=engine, policy=policy,
                                        settings=settings, worker=worker, adapters=adapters)


async def _sample_and_record(req: RolloutRequestedPayload, task: TaskSpec, *,
                             engine: AsyncEngine, policy: Policy, settings: Settings,
                             worker: str, adapters: AdapterResolver) -> GroupOutcome:
    group_id = req.request_id
    adapter = await adapters(req.adapter_version)
    if adapter is not None:
        await adapters.protect_production(policy)
        await policy.ensure_adapter(adapter)
    cfg = group_config(settings)
    seed = zlib.crc32(group_id.bytes)
    outcome = await run_group(policy, task, load_environment(task.env), cfg, adapter=adapter,
                              seed=seed, group_key=str(group_id))
    async with engine.begin() as conn:
        await store.record_group(
            conn, group_id=group_id, task=task, outcome=outcome,
            adapter=adapter.name if adapter else None, adapter_version=req.adapter_version,
            temperature=cfg.temperature, worker=worker,
            retire_after=settings.rollout.retire_after,
            topics=settings.topics)
    return outcome


async def mark_failed(conn: Any, request_id: uuid.UUID) -> None:
    """The request will never be answered (its task or adapter is gone, or it was parked):
    it stops holding admission budget at once."""
    await conn.execute(text("""UPDATE rollout_requests SET status = 'failed', done_at = now()
                               WHERE request_id = :g AND status = 'requested'"""),
                       {"g": request_id})


def worker_name() -> str:
    import os
    import socket

    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:4]}"
