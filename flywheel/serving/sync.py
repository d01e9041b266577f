"""Serving: the `production` alias, and following the production pointer.

The API process is the serving front end. `ServingSync` watches the production pointer
(the projection of promotions and rollbacks); when it moves, the new version is loaded on
every replica of the configured engine and verified there — vLLM: `load_lora_adapter` on
each replica, then `/v1/models` must list it; local engine: the checksummed artifact loaded
in process — and only then does the alias move and `ServingSwitched` get recorded. Agents
call `POST /v1/chat/completions` with `model: "production"` and get the version the alias
points at; the response's `model` names it (`<policy>@v<N>`, or the base model). How a
request is answered is in `flywheel.serving.completions`, the routes in `serving.routes`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import lifecycle
from flywheel.adapters.resolver import AdapterResolver
from flywheel.config import Settings
from flywheel.events import ServingSwitched, ServingSwitchedPayload
from flywheel.policy.base import AdapterRef, Policy

log = logging.getLogger("flywheel.serving")
_INT32_MAX = 2**31 - 1
"""Adapter versions are a Postgres `integer` column."""

ALIASES = ("production",)
PLACE_TTL_S = 30.0
"""How long a version addressed as `<policy>@vN` counts as placed on every replica."""


@dataclass(frozen=True)
class Target:
    version: int | None
    adapter: AdapterRef | None

    @property
    def name(self) -> str:
        return self.adapter.name if self.adapter else "base"


class ServingSync:
    def __init__(self, settings: Settings, engine: AsyncEngine,
                 policy: Policy | None = None) -> None:
        self.settings, self.engine = settings, engine
        self.name = settings.policy
        self._policy = policy
        self._policy_lock = threading.Lock()
        self.adapters = AdapterResolver(engine, settings)
        self.current: Target | None = None
        self._lock = asyncio.Lock()
        self._placed: dict[int, float] = {}
        """Explicitly addressed versions → when they were last placed on every replica."""

    def policy(self) -> Policy:
        """The serving engine, built on first use (the local engine loads the model: call
        this from a thread, as `complete` does)."""
        with self._policy_lock:
            if self._policy is None:
                from flywheel.policy.factory import make_policy

                self._policy = make_policy(self.settings)
            return self._policy

    async def loaded_policy(self) -> Policy:
        """`policy()` without blocking the event loop while the engine loads."""
        return self._policy if self._policy is not None else await asyncio.to_thread(self.policy)

    def replicas(self, target: Target | None = None) -> list[str]:
        """Where `target` serves: the replicas that loaded and verified it (a replica that
        was down is left out, and loaded once it answers), else every configured one."""
        r = self.settings.rollout
        if r.engine != "vllm":
            return ["local"]
        placed = getattr(self._policy, "replicas_serving", None)
        if target is not None and target.adapter is not None and placed is not None:
            return list(placed(target.adapter.name))
        return list(r.vllm_urls)

    async def sync_once(self) -> bool:
        """Follow the pointer once; True when the alias moved."""
        async with self._lock:
            async with self.engine.connect() as conn:
                row = (await conn.execute(text("""SELECT p.version, s.version AS serving,
                        s.served_name FROM production p
                    LEFT JOIN serving_state s USING (policy) WHERE p.policy = :p"""),
                    {"p": self.name})).first()
            if row is None:
                if self.current is None:
                    self.current = Target(None, None)
                return False
            if self.current is not None and self.current.version == row.version:
                await self._keep_placed(self.current)
                return False
            adapter = await self.adapters(row.version)
            policy = await self.loaded_policy()
            pin = getattr(policy, "pin_production", None)
            if pin is not None:  # vLLM: no process's retention may unload it (see there)
                pin(adapter.name if adapter is not None else None)
            if adapter is not None:
                await self._place(adapter)  # on every replica, verified, before the alias moves
            target = Target(row.version, adapter)
            if row.serving != row.version or row.served_name is None:
                await self._record(target)
            self.current = target
            log.info("production alias → %s on %s", target.name, self.replicas(target))
            return True

    async def _keep_placed(self, target: Target) -> None:
        """Place production again every PLACE_TTL_S: a replica that restarted, or retention
        in a process that had not seen the promotion yet, may have dropped it (vLLM's
        replicas are shared); `ensure_adapter` only lists where nothing was lost."""
        if target.adapter is not None:
            await self._place(target.adapter, ttl_s=PLACE_TTL_S)

    async def place_again(self, target: Target) -> None:
        """`target` was found unloaded while answering: place it now (not at the next TTL)."""
        if target.adapter is not None:
            await self._place(target.adapter)

    async def _place(self, adapter: AdapterRef, ttl_s: float = 0.0) -> None:
        """`ensure_adapter` on every replica, unless it was done within `ttl_s`: it checks
        every replica (vLLM: a listing each, under one admin lock), so not on every call."""
        if time.monotonic() - self._placed.get(adapter.version, -ttl_s) < ttl_s:
            return
        await (await self.loaded_policy()).ensure_adapter(adapter)
        self._placed[adapter.version] = time.monotonic()

    async def _record(self, target: Target) -> None:
        async with self.engine.begin() as conn:
            await lifecycle.lock_production(conn, self.name)
            cause = (await conn.execute(text("""SELECT event_id FROM events
                WHERE type IN ('AdapterPromoted', 'AdapterRolledBack')
                  AND payload->>'policy' = :p ORDER BY seq DESC LIMIT 1"""),
                {"p": self.name})).scalar()
            event = ServingSwitched(aggregate_id=f"{self.name}@serving",
                                    payload=ServingSwitchedPayload(
                                        policy=self.name, version=target.version,
                                        served_name=target.name,
                                        replicas=self.replicas(target),
                                        cause_event_id=cause))
            await lifecycle.apply_event(conn, event, self.settings.topics)

    async def run(self, stop: asyncio.Event, poll_s: float = 1.0) -> None:
        while not stop.is_set():
            try:
                await self.sync_once()
            except Exception as err:  # keep serving the previous version; try again
                log.warning("serving sync failed (still serving %s): %s",
                            self.current.name if self.current else "nothing yet", err)
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except TimeoutError:
                pass

    async def resolve(self, model: str) -> Target:
        """`production` (or `<policy>:production`) → the verified target; `<policy>@vN` and
        `base` address a version directly."""
        if model in ALIASES or model == f"{self.name}:production":
            if self.current is None:
                await self.sync_once()
            assert self.current is not None
            return self.current
        if model == "base":
            return Target(None, None)
        version = addressed_version(model, self.name)
        if version is not None:
            adapter = await self.adapters(version)
            if adapter is not None:
                await self._place(adapter, ttl_s=PLACE_TTL_S)
            return Target(version, adapter)
        raise LookupError(f"unknown model {model!r}: use 'production', 'base' or "
                          f"'{self.name}@v<N>'")

    async def close(self) -> None:
        if self._policy is not None:
            await self._policy.close()



def addressed_version(model: str, policy: str) -> int | None:
    """N of `<policy>@vN`, None when `model` does not address a version. N is ASCII digits
    (`str.isdigit` also takes '²', '٣', '０') within the `integer` column's range: a version
    that cannot exist is an unknown model (404), never a driver error or a Unicode digit
    read as another version."""
    prefix = f"{policy}@v"
    digits = model[len(prefix):] if model.startswith(prefix) else ""
    if not (0 < len(digits) <= 10 and digits.isascii() and digits.isdigit()):
        return None
    version = int(digits)
    return version if 1 <= version <= _INT32_MAX else None
