"""Liveness and readiness: `/healthz` says the process serves, `/readyz` whether it can work.

A router's lifespan hook registers a *probe* for each dependency it needs
(`add_probe(app, "postgres", fn)`): an async function that raises when the dependency does
not answer. `/readyz` runs every probe (each bounded by `PROBE_TIMEOUT_S`) and answers 200
when all pass, else 503 naming what is down and why; it is also 503 while intake is closed
(`flywheel down` is draining), so a load balancer stops sending trajectories here.
Results are reused for `CACHE_S`: probes cost a round trip each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

Probe = Callable[[], Awaitable[None]]
PROBE_TIMEOUT_S = 2.0
CACHE_S = 1.0


def add_probe(app: FastAPI, name: str, probe: Probe) -> None:
    """Register `probe` (raises when `name` is down) for `/readyz` and the status pages."""
    if not hasattr(app.state, "probes"):
        app.state.probes = {}
    app.state.probes[name] = probe


async def _run(probe: Probe) -> str | None:
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            await probe()
    except TimeoutError:
        return f"no answer within {PROBE_TIMEOUT_S:.0f}s"
    except Exception as err:
        return f"{type(err).__name__}: {err}"[:300] if str(err) else type(err).__name__
    return None


async def dependencies(app: FastAPI) -> dict[str, dict[str, Any]]:
    """`{name: {"up": bool, "error": str | None}}` for every registered probe (cached)."""
    cached: tuple[float, dict[str, dict[str, Any]]] | None = getattr(
        app.state, "probe_cache", None)
    if cached is not None and time.monotonic() - cached[0] < CACHE_S:
        return cached[1]
    probes: dict[str, Probe] = getattr(app.state, "probes", {})
    names = sorted(probes)
    errors = await asyncio.gather(*(_run(probes[n]) for n in names))
    found = {n: {"up": e is None, "error": e} for n, e in zip(names, errors, strict=True)}
    app.state.probe_cache = (time.monotonic(), found)
    return found


def health_router() -> APIRouter:
    router = APIRouter(tags=["ops"])

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves HTTP (200 whatever its dependencies do). No token."""
        return {"status": "ok"}

    @router.get("/readyz", responses={503: {"description": "a dependency is down, or intake "
                                                          "is closed for draining"}})
    async def readyz(request: Request) -> JSONResponse:
        """Readiness: every dependency (database, broker) answers and intake is open → 200;
        else 503 with what is down and why. No token."""
        deps = await dependencies(request.app)
        down = sorted(n for n, d in deps.items() if not d["up"])
        intake = getattr(request.app.state, "intake", None)
        closed = intake is not None and not intake.open
        body: dict[str, Any] = {"status": "ready" if not down and not closed else "not ready",
                                "dependencies": deps, "down": down,
                                "intake": "closed" if closed else "open"}
        if down or closed:
            why = [f"{n} is down ({deps[n]['error']})" for n in down]
            if closed:
                why.append("intake is closed (the stack is draining)")
            body["detail"] = "; ".join(why)
        return JSONResponse(body, status_code=503 if down or closed else 200,
                            headers={"Cache-Control": "no-store"})

    return router
