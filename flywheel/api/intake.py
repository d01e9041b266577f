"""Intake: whether this API process accepts trajectories, and closing it without losing any.

`flywheel down` closes intake before it drains: from then on `POST /v1/trajectories` answers
503 with `Retry-After` (clients keep their records and retry, SDK clients spool), and the
close returns only once every request already admitted has finished publishing, so nothing
the gateway acknowledged can still be on its way to the broker when the drain measures lag.

`POST /v1/intake {"open": false}` (operate scope) closes it, `{"open": true}` reopens it;
`GET /v1/intake` says where it stands. Intake is per process: with several API replicas,
close each one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request, status
from pydantic import BaseModel, Field

from flywheel.web.auth import Principal, require_scope

RETRY_AFTER_S = 5


class Intake:
    """Open or closed, and how many admitted requests are still publishing."""

    def __init__(self) -> None:
        self.open = True
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold one request's place while it publishes; 503 when intake is closed."""
        if not self.open:
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE,
                f"intake is closed: the stack is draining to stop; retry in {RETRY_AFTER_S}s"
                " (nothing was published; re-sending is safe)",
                headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def close(self, wait_s: float) -> bool:
        """Refuse new requests; True once the admitted ones are done (False: `wait_s` ran out
        first — they finish or fail on their own; their clients see the outcome)."""
        self.open = False
        try:
            async with asyncio.timeout(wait_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


def intake_of(app: FastAPI) -> Intake:
    """The app's intake (created on first use)."""
    intake: Intake | None = getattr(app.state, "intake", None)
    if intake is None:
        intake = app.state.intake = Intake()
    return intake


class IntakeChange(BaseModel):
    open: bool = Field(description="false: refuse new trajectories (503) and wait for the "
                                   "admitted ones; true: accept again.")
    wait_s: float = Field(default=15.0, ge=0, le=300,
                          description="Longest wait for admitted requests when closing.")


def intake_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["ops"])

    @router.get("/intake")
    async def get_intake(request: Request, _: Principal = require_scope(None)
                         ) -> dict[str, Any]:
        """Whether trajectories are accepted, and how many requests are publishing."""
        intake = intake_of(request.app)
        return {"open": intake.open, "in_flight": intake.in_flight}

    @router.post("/intake")
    async def set_intake(change: IntakeChange, request: Request,
                         _: Principal = require_scope("operate")) -> dict[str, Any]:
        """Close intake (returns once admitted requests are done) or reopen it."""
        intake = intake_of(request.app)
        settled = True
        if change.open:
            intake.open = True
        else:
            settled = await intake.close(change.wait_s)
        return {"open": intake.open, "in_flight": intake.in_flight, "settled": settled}

    return router
