"""Registered adapter versions, fetched from the artifact store and verified once per process."""

from __future__ import annotations

import asyncio

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import registry
from flywheel.adapters.factory import artifact_store
from flywheel.config import Settings
from flywheel.errors import PermanentError
from flywheel.policy.base import AdapterRef, served_name


class UnknownAdapter(PermanentError, LookupError):
    """A version of the policy that was never registered (a request for it cannot be met)."""


class AdapterResolver:
    """Registered adapter versions of the policy, fetched from the artifact store (S3) and
    checksum-verified once per process: versions are immutable, so a verified reference
    stays valid, and a tampered or truncated artifact is refused (`CorruptAdapter`)."""

    def __init__(self, engine: AsyncEngine, settings: Settings) -> None:
        self.engine, self.policy = engine, settings.policy
        self.store = artifact_store(settings)
        self._verified: dict[int, AdapterRef] = {}

    async def __call__(self, version: int | None) -> AdapterRef | None:
        if version is None:
            return None
        if version not in self._verified:
            async with self.engine.connect() as conn:
                registered = (await conn.execute(text(
                    "SELECT 1 FROM adapter_versions WHERE policy = :p AND version = :v"),
                    {"p": self.policy, "v": version})).scalar()
            if registered is None:
                raise UnknownAdapter(f"adapter {self.policy}@v{version} is not registered")
            ref, _ = await asyncio.to_thread(self.store.load, self.policy, version)
            self._verified[version] = ref
        return self._verified[version]

    async def protect_production(self, policy: object) -> None:
        """Pin the version production serves on an engine whose replicas every process
        shares (vLLM: `pin_production`), so that this process's retention never unloads it
        from under the serving endpoint. Call it before placing a version; an engine of this
        process alone (the local one) has nothing to protect."""
        pin = getattr(policy, "pin_production", None)
        if pin is None:
            return
        async with self.engine.connect() as conn:
            version = await registry.production_version(conn, self.policy)
        pin(None if version is None else served_name(self.policy, version))
