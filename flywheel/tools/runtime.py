"""Registered toolsets at work in one process: sessions opened under a bound, by name.

A `ToolsetRuntime` is one registration with its backend and its session slots: at most
`max_sessions` episodes are open on it at once in this process. A group's episodes take
their slots together (`open_sessions`), first come first served: two groups that each got
half of what they need can never wait on each other. A backend that spawns a server per
session (`McpBackend.start_bound`) also bounds how many start at once: spawning is CPU
work, and dozens started together all finish late (48 at once: 23 s on an idle 2-core
machine, under load past the SDK's handshake); a session's wait for its turn is not
counted in `open_timeout_s`. (Only
the opening of an episode's session waits its turn; a live session an episode opens later
— a replay that diverged under the rule `live`, the end-state snapshot of an episode that
stayed on its logged path — starts at once.) The `Catalog` finds the runtime of a
toolset by name through a resolver (the registry in Postgres for services, a fixed set in
tests and benchmarks), keeping each for `refresh_s`: a newer version applies to episodes
started after that, while episodes on the old one finish on it.

Environments are plugins built without arguments, and every environment instance in a
process must share one catalog (or the per-toolset bound would be per instance): services
install theirs with `use_catalog` at start; `default_catalog` is what a plugin gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from flywheel.tasks import RolloutNotRun
from flywheel.tools.backend import Backend, ToolsetError, unavailable
from flywheel.tools.descriptors import Registration
from flywheel.tools.mcp_backend import McpBackend
from flywheel.tools.python_backend import PythonBackend
from flywheel.tools.safety import unsafe_tools
from flywheel.tools.session import EpisodePlan, ToolSession
from flywheel.toolsets import PythonClass, ToolsetConfig

Resolver = Callable[[str], Awaitable[Registration | None]]


def make_backend(name: str, config: ToolsetConfig,
                 registration: Registration | None = None) -> Backend:
    if isinstance(config, PythonClass):
        return PythonBackend(name, config)
    return McpBackend(name, config, registration)


class Slots:
    """A counting bound whose waiters take several slots at once, in arrival order."""

    def __init__(self, total: int) -> None:
        self.total, self.free = total, total
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, n: int) -> None:
        if n > self.total:
            raise ValueError(f"{n} sessions at once, but the toolset allows {self.total} "
                             f"(max_sessions); raise it to at least the group size")
        if not self._waiting and self.free >= n:
            self.free -= n
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((n, future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(n)  # granted as it was cancelled: hand the slots back
            else:
                self._waiting.remove((n, future))
                self._wake()
            raise

    def release(self, n: int) -> None:
        self.free += n
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._waiting[0][0] <= self.free:
            n, future = self._waiting.popleft()
            if not future.done():
                self.free -= n
                future.set_result(None)


class ToolsetRuntime:
    def __init__(self, registration: Registration, backend: Backend | None = None) -> None:
        self.registration = registration
        self.backend = backend or make_backend(registration.name, registration.config,
                                               registration)
        self.slots = Slots(registration.config.max_sessions)
        bound: int | None = getattr(self.backend, "start_bound", None)
        self._starting = asyncio.Semaphore(bound) if bound else None
        """Sessions starting at once (a backend that spawns a server per session says how
        many); the wait for a turn is not the session's open time."""
        self.unsafe = unsafe_tools(registration)
        self.open_now = 0

    @property
    def name(self) -> str:
        return self.registration.name

    async def open_sessions(self, plans: list[EpisodePlan]
                            ) -> list[ToolSession | RolloutNotRun]:
        """A session per plan, their slots taken together; a session that could not start
        is its `RolloutNotRun` (its slot given back)."""
        await self.slots.acquire(len(plans))
        self.open_now += len(plans)
        opened = await asyncio.gather(*(self._start(p) for p in plans))
        failed = sum(isinstance(s, RolloutNotRun) for s in opened)
        self._release(failed)
        return list(opened)

    async def _start(self, plan: EpisodePlan) -> ToolSession | RolloutNotRun:
        session = ToolSession(self.registration, self.backend, plan, self.unsafe)
        try:
            async with self._starting or contextlib.nullcontext():
                await asyncio.wait_for(session.start(),
                                       self.registration.config.open_timeout_s)
        except RolloutNotRun as err:
            return err
        except TimeoutError:
            return unavailable(self.name, f"no session within "
                               f"{self.registration.config.open_timeout_s:g}s")
        return session

    async def end_state(self, initial_state: dict[str, Any] | None,
                        calls: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
        """The state `calls` (`{"name", "arguments"}` each) reach from `initial_state` on a
        fresh session: a reference end state (None: the toolset keeps no snapshot). Strict:
        a call that errs or is refused is a `ValueError` naming it — a reference must not
        build on a call that did nothing."""
        (session,) = await self.open_sessions([EpisodePlan(
            key=f"reference-{uuid.uuid4().hex[:12]}", initial_state=initial_state)])
        if isinstance(session, RolloutNotRun):
            raise session
        try:
            for n, call in enumerate(calls, start=1):
                done = await session.call(str(call["name"]), dict(call.get("arguments") or {}))
                if done.step.status != "ok" or done.step.source != "live":
                    raise ValueError(f"reference call {n} ({call['name']}) did not run: "
                                     f"{done.observation[:300]}")
            return await session.snapshot()
        finally:
            await self.close_session(session)

    async def close_session(self, session: ToolSession) -> None:
        try:
            await session.close()
        finally:
            self._release(1)

    def _release(self, n: int) -> None:
        if n:
            self.open_now -= n
            self.slots.release(n)

    async def aclose(self) -> None:
        await self.backend.aclose()


class Catalog:
    def __init__(self, resolve: Resolver, refresh_s: float = 10.0) -> None:
        self._resolve, self.refresh_s = resolve, refresh_s
        self._runtimes: dict[str, tuple[float, ToolsetRuntime]] = {}
        self._retired: list[ToolsetRuntime] = []
        self._lock = asyncio.Lock()

    @classmethod
    def of(cls, registrations: Iterable[Registration],
           backends: dict[str, Backend] | None = None) -> Catalog:
        """A catalog of fixed registrations (tests, benchmarks)."""
        known = {r.name: r for r in registrations}

        async def resolve(name: str) -> Registration | None:
            return known.get(name)

        catalog = cls(resolve, refresh_s=float("inf"))
        for name, backend in (backends or {}).items():
            catalog._runtimes[name] = (time.monotonic(), ToolsetRuntime(known[name], backend))
        return catalog

    async def runtime(self, name: str) -> ToolsetRuntime:
        async with self._lock:
            if self._retired:
                await self._reap()
            now = time.monotonic()
            cached = self._runtimes.get(name)
            if cached is not None and now - cached[0] < self.refresh_s:
                return cached[1]
            try:
                found = await self._resolve(name)
            except Exception as exc:
                if cached is not None:  # the registry is down: keep using what we have
                    return cached[1]
                raise unavailable(name, f"its registration could not be read: {exc}") from exc
            if found is None:
                raise unavailable(name, "no such toolset is registered (flywheel tools ls)")
            if cached is not None and cached[1].registration.version == found.version:
                self._runtimes[name] = (now, cached[1])
                return cached[1]
            runtime = ToolsetRuntime(found)
            if cached is not None:
                self._retired.append(cached[1])
            self._runtimes[name] = (now, runtime)
            return runtime

    async def _reap(self) -> None:
        """Close the backends of replaced versions once their episodes are over."""
        done = [r for r in self._retired if r.open_now == 0]
        self._retired = [r for r in self._retired if r.open_now > 0]
        for runtime in done:
            await runtime.aclose()

    async def aclose(self) -> None:
        for runtime in [*(r for _, r in self._runtimes.values()), *self._retired]:
            await runtime.aclose()
        self._runtimes.clear()
        self._retired.clear()


_default: Catalog | None = None


def use_catalog(catalog: Catalog | None) -> None:
    """Install the catalog every toolset environment in this process uses."""
    global _default
    _default = catalog


def default_catalog() -> Catalog:
    if _default is None:
        raise ToolsetError("no toolset catalog in this process: services install one at "
                           "start (flywheel.tools.registry.registry_catalog); tests pass a "
                           "Catalog to ToolsetEnvironment")
    return _default


def describe_runtime(runtime: ToolsetRuntime) -> dict[str, Any]:
    return {"name": runtime.name, "version": runtime.registration.version,
            "open_sessions": runtime.open_now, "max_sessions": runtime.slots.total}
