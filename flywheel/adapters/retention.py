"""Adapter retention: which published versions may be deleted, and deleting them. Never one a
rollout still needs, nor one a vLLM replica still lists (vLLM reads the directory again after
an eviction from `--max-cpu-loras`, and a missing one kills the replica's engine)."""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import registry
from flywheel.adapters.artifacts import ArtifactStore
from flywheel.config import RolloutSettings

log = logging.getLogger("flywheel.adapters")


async def served_versions(rollout: RolloutSettings, policy: str) -> set[int] | None:
    """Versions the vLLM replicas list (empty with the local engine); None when a replica
    cannot be asked, so that nothing is deleted blind."""
    if rollout.engine != "vllm":
        return set()
    from flywheel.policy import vllm
    from flywheel.policy.base import PolicyError

    try:
        return await vllm.served_versions(rollout.vllm_urls, policy)
    except PolicyError as err:
        log.warning("retention skipped this time: cannot tell which versions the vLLM "
                    "replicas still serve (%s)", err)
        return None


async def retain(engine: AsyncEngine, store: ArtifactStore, policy: str, *, keep: int,
                 rollout: RolloutSettings) -> None:
    """Delete old versions of `policy` beyond `keep`, except those in use or served; then
    remove what crashed publishes left behind."""
    async with engine.connect() as conn:
        in_use = await registry.versions_in_use(conn, policy)
    served = await served_versions(rollout, policy)
    if served is not None:
        deleted = await asyncio.to_thread(store.retain, policy, keep, in_use | served)
        if deleted:
            log.info("retention removed %s@v%s", policy, deleted)
    leftovers = await asyncio.to_thread(store.gc_temp, policy)
    if leftovers:
        log.info("removed %d leftovers of crashed publishes", len(leftovers))
