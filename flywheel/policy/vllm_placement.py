"""Where each adapter version is loaded on the vLLM replicas, and for how long.

`AdapterPlacement.ensure` loads an immutable version name (`<policy>@v<N>`) on every
reachable replica, verifies each through `/v1/models` and only then routes to it; a name
already listed is never loaded again (reloading a name serves stale prefix-cache entries),
and a name once placed from one directory is refused from any other, even after it was
retired. Retention keeps the newest `retention` versions plus the pinned ones (production,
baseline). An adapter the server refuses (rank too big, unreadable weights: HTTP 500 from
vLLM) fails at once with the fix (`AdapterLoadError`); a replica that is down is skipped and
placed on a later call once it answers.

`served_versions` asks the replicas which versions they still list, so the trainer's
retention deletes none of them. The HTTP calls themselves (retries, benching, load) are
the engine's (`vllm.VLLMPolicy`): a placement is handed its replicas and its one call.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import httpx

from flywheel.policy.base import AdapterNotServed, AdapterRef, PolicyError, served_name
from flywheel.policy.vllm_errors import (
    AdapterLoadError,
    ReplicaUnavailable,
    VLLMError,
    error_message,
    load_fix,
    unavailable,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class Replica(Protocol):
    url: str
    adapters: dict[str, str]
    """Adapter names verified in this replica's /v1/models, with their paths (where
    sampling may route)."""


R = TypeVar("R", bound=Replica)
R_contra = TypeVar("R_contra", bound=Replica, contravariant=True)


class ReplicaCall(Protocol[R_contra]):
    """One HTTP call to one replica, retried there (fan-out must reach this replica)."""

    def __call__(self, r: R_contra, method: str, path: str,
                 body: dict[str, Any] | None = None) -> Awaitable[Any]: ...


def _same_path(root: str | None, path: str) -> bool:
    # vLLM lists the path it was given as `root`; a server that omits it cannot contradict us.
    return root is None or os.path.normpath(root) == os.path.normpath(path)


class AdapterPlacement(Generic[R]):
    """The versions of one policy on a set of replicas: placement, pins and retention."""

    def __init__(self, replicas: Sequence[R], call: ReplicaCall[R], *, policy_name: str,
                 retention: int, pinned: set[str] | None = None, verify_attempts: int = 5,
                 verify_delay_s: float = 0.5) -> None:
        if retention < 1:
            raise ValueError(f"retention must be >= 1 (max staleness + 1), got {retention}")
        self.replicas, self._call = replicas, call
        self.policy_name, self.retention = policy_name, retention
        self._pinned: set[str] = set(pinned or ())
        self._production: str | None = None
        self._verify_attempts, self._verify_delay_s = verify_attempts, verify_delay_s
        self._admin = asyncio.Lock()  # loads/unloads are rare; serialising them avoids races
        self._paths: dict[str, str] = {}
        """Every adapter name this instance placed → its directory; kept after retiring, so
        a version name never comes back with other weights."""
        self._retired: set[str] = set()

    # -- pins ---------------------------------------------------------------------------------
    @property
    def pinned(self) -> frozenset[str]:
        return frozenset(self._pinned)

    def pin(self, name: str) -> None:
        """Never unload `name` (production and baseline versions)."""
        self._pinned.add(name)

    def unpin(self, name: str) -> None:
        self._pinned.discard(name)

    def pin_production(self, name: str | None) -> None:
        """Pin what production serves now (None: the base model), unpinning what it served
        before. Every process's engine shares the replicas, and retention in any of them
        (a rollout worker placing its newest version) would otherwise unload production
        under the serving endpoint: each service pins it from the database
        (`AdapterResolver.protect_production`) before it places anything."""
        if name == self._production:
            return
        if self._production is not None:
            self._pinned.discard(self._production)
        self._production = name
        if name is not None:
            self._pinned.add(name)

    def replicas_serving(self, name: str) -> list[str]:
        """The replicas `name` was placed and verified on (where sampling may go)."""
        return [r.url for r in self.replicas if name in r.adapters]

    # -- placing and retiring -----------------------------------------------------------------
    async def ensure(self, adapter: AdapterRef) -> None:
        self._check_policy(adapter)
        known = self._paths.get(adapter.name)
        if known is not None and not _same_path(known, str(adapter.path)):
            raise PolicyError(f"{adapter.name} was placed from {known} before, not "
                              f"{adapter.path}: a version name is immutable; publish the new "
                              "weights as a new version")
        async with self._admin:
            # Check every reachable replica before loading anywhere: a name served from
            # another path is a broken invariant. A replica that is down is skipped (it is
            # checked and loaded on a later call once it answers): one dead replica must not
            # stop new versions from serving on the others, and sampling only ever routes to
            # replicas verified here.
            up = await _reachable([self._listing(r) for r in self.replicas],
                                  self.replicas, f"place {adapter.name}")
            for r, listing in up:
                if adapter.name in listing:
                    self._check_root(r, adapter.name, listing[adapter.name], str(adapter.path))
            self._paths[adapter.name] = str(adapter.path)
            self._retired.discard(adapter.name)
            placed = await _reachable([self._place(r, adapter, listing) for r, listing in up],
                                      [r for r, _ in up], f"place {adapter.name}")
            await self._enforce_retention(adapter.name, [listing for _, listing in placed])

    async def retire(self, adapter: AdapterRef) -> None:
        self._check_policy(adapter)
        if adapter.name in self._pinned:
            raise PolicyError(f"{adapter.name} is pinned (production or baseline); unpin it "
                              "before retiring it")
        async with self._admin:
            await self._unload_everywhere(adapter.name)
            self._retired.add(adapter.name)

    async def serving(self, adapter: AdapterRef) -> list[R]:
        """Replicas verified to serve `adapter`; asks /v1/models once when none is known."""
        serving = [r for r in self.replicas if adapter.name in r.adapters]
        if serving:
            return serving
        results = await asyncio.gather(*(self._listing(r) for r in self.replicas),
                                       return_exceptions=True)
        found = [(r, listing[adapter.name]) for r, listing in zip(self.replicas, results,
                 strict=True) if isinstance(listing, dict) and adapter.name in listing]
        for r, root in found:  # all checked before any is routed to
            self._check_root(r, adapter.name, root, str(adapter.path))
        for r, _ in found:
            r.adapters[adapter.name] = str(adapter.path)
        serving = [r for r in self.replicas if adapter.name in r.adapters]
        if not serving:
            if adapter.name in self._retired:
                raise PolicyError(f"{adapter.name} was retired; call ensure_adapter first "
                                  "(sampling never loads an adapter by itself)")
            raise AdapterNotServed(f"{adapter.name} is not loaded on any replica; call "
                                   "ensure_adapter first (sampling never loads an adapter by "
                                   "itself)")
        return serving

    async def _place(self, r: R, adapter: AdapterRef,
                     listing: dict[str, str | None]) -> dict[str, str | None]:
        """Load `adapter` on `r` unless it is listed there already, then verify the listing."""
        name, path = adapter.name, str(adapter.path)
        if name not in listing:
            try:
                await self._call(r, "POST", "/v1/load_lora_adapter",
                                 {"lora_name": name, "lora_path": path})
                log.info("loaded %s from %s on %s", name, path, r.url)
            except VLLMError as e:
                # "already been loaded": a concurrent loader won; verification checks its path.
                if not (e.status == 400 and "already" in e.message):
                    if e.kind != "permanent":
                        raise
                    raise AdapterLoadError(r.url, name, e.status, e.message,
                                           load_fix(e, path)) from e
            listing = await self._verify(r, name, path)
        r.adapters[name] = path
        return listing

    async def _verify(self, r: R, name: str, path: str) -> dict[str, str | None]:
        for attempt in range(self._verify_attempts):
            listing = await self._listing(r)
            if name in listing:
                self._check_root(r, name, listing[name], path)
                return listing
            await asyncio.sleep(self._verify_delay_s * (attempt + 1))
        raise PolicyError(f"replica {r.url} accepted {name} but does not list it in /v1/models "
                          f"after {self._verify_attempts} checks; not routing to it")

    def _check_root(self, r: R, name: str, root: str | None, path: str) -> None:
        if not _same_path(root, path):
            raise PolicyError(f"replica {r.url} serves {name} from {root}, not {path}: a version "
                              "name is immutable; publish the new weights as a new version")

    async def _enforce_retention(self, keep: str, listings: list[dict[str, str | None]]) -> None:
        pattern = re.compile(rf"^{re.escape(self.policy_name)}@v(\d+)$")
        versions = sorted({int(m.group(1)) for listing in listings for name in listing
                           if (m := pattern.match(name))})
        newest = set(versions[-self.retention:])
        for version in versions:
            name = served_name(self.policy_name, version)
            if version in newest or name == keep or name in self._pinned:
                continue
            try:
                await self._unload_everywhere(name)
            except PolicyError as e:
                # The new version is already servable; a failed cleanup is retried next time.
                log.warning("retention could not unload %s: %s", name, e)

    async def _unload_everywhere(self, name: str) -> None:
        async def unload(r: R) -> None:
            r.adapters.pop(name, None)  # stop routing here before the server drops it
            try:
                await self._call(r, "POST", "/v1/unload_lora_adapter", {"lora_name": name})
                log.info("unloaded %s on %s", name, r.url)
            except VLLMError as e:
                if not (e.status in (400, 404) and "cannot be found" in e.message):
                    if e.status == 404 and e.message.strip() == "Not Found":
                        raise PolicyError(f"unloading {name} on {r.url}: {load_fix(e, '')}"
                                          ) from e
                    raise

        await fan_out([unload(r) for r in self.replicas])

    def _check_policy(self, adapter: AdapterRef) -> None:
        if adapter.policy != self.policy_name:
            raise PolicyError(f"{adapter.name} belongs to policy {adapter.policy!r}; this "
                              f"VLLMPolicy manages {self.policy_name!r}")

    async def _listing(self, r: R) -> dict[str, str | None]:
        data = await self._call(r, "GET", "/v1/models")
        return {card["id"]: card.get("root") for card in data.get("data", [])}


async def served_versions(base_urls: Sequence[str], policy_name: str, *,
                          timeout_s: float = 10.0, api_key: str | None = None,
                          transport: httpx.AsyncBaseTransport | None = None) -> set[int]:
    """Versions of `policy_name` that any replica still lists in `/v1/models`. vLLM reads a
    listed adapter's directory again whenever it falls out of `--max-cpu-loras`, so none of
    these may be deleted. Raises PolicyError when a replica cannot be asked: then nothing
    may be deleted."""
    pattern = re.compile(rf"^{re.escape(policy_name)}@v(\d+)$")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(transport=transport, timeout=timeout_s,
                                 headers=headers) as client:
        async def listing(url: str) -> list[str]:
            try:
                resp = await client.get(url.rstrip("/") + "/v1/models")
            except httpx.TransportError as e:
                raise PolicyError(f"replica {url} unreachable for GET /v1/models: {e!r}") from e
            if resp.status_code >= 400:
                raise VLLMError(url, resp.status_code, error_message(resp))
            return [str(card["id"]) for card in resp.json().get("data", [])]

        names = await fan_out([listing(url) for url in base_urls])
    return {int(m.group(1)) for listed in names for name in listed if (m := pattern.match(name))}


async def _reachable(calls: Sequence[Awaitable[T]], replicas: Sequence[R],
                     what: str) -> list[tuple[R, T]]:
    """Run one call per replica to the end; results of those that answered. Replicas that
    are unavailable are logged and left out, unless all are; any other error is raised."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    down = [(r, e) for r, e in zip(replicas, results, strict=True)
            if isinstance(e, BaseException) and unavailable(e)]
    await fan_out([_raise(e) for e in results if isinstance(e, BaseException)
                   and not unavailable(e)])
    answered = [(r, v) for r, v in zip(replicas, results, strict=True)
                if not isinstance(v, BaseException)]
    if down and not answered:
        raise ReplicaUnavailable(f"cannot {what}: no replica is available ("
                                 + "; ".join(str(e) for _, e in down) + ")") from down[0][1]
    for r, e in down:
        log.warning("could not %s on %s (skipped until it answers again): %s", what, r.url, e)
    return answered


async def _raise(e: BaseException) -> None:
    raise e


async def fan_out(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Run every call to the end (no replica is left half-done); raise all failures together."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [e for e in results if isinstance(e, BaseException)]
    for e in errors:
        if not isinstance(e, Exception):
            raise e  # cancellation and friends
    if len(errors) == 1:
        raise errors[0]
    if errors and all(isinstance(e, AdapterLoadError) for e in errors):
        first = errors[0]
        assert isinstance(first, AdapterLoadError)
        first.others = [e for e in errors[1:] if isinstance(e, AdapterLoadError)]
        raise first
    if errors:
        raise PolicyError("; ".join(str(e) for e in errors)) from errors[0]
    return [r for r in results if not isinstance(r, BaseException)]
