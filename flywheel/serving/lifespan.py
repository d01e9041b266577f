"""The serving endpoint's lifespan hook: the `ServingSync` the OpenAI routes answer from.

`serving_lifespan` opens serving's own database pool (chat and the production pointer's
polling do not wait behind operator queries), keeps the `ServingSync` on
`app.state.serving` and, with `api.serve`, follows the production pointer until the app
stops; then it closes the engine's clients and the pool.

Mount with `create_app(settings, routers=[serving_router(), responses_router()],
lifespan_hooks=[serving_lifespan])`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from flywheel.db.engine import make_engine
from flywheel.runtime.endpoints import resolve_db_url
from flywheel.serving.sync import ServingSync
from flywheel.web.app import settings_of

POOL_SIZE = 4
"""Serving's connections (as many again on overflow): pointer polls, version lookups,
stored responses."""


@asynccontextmanager
async def serving_lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings = settings_of(app)
    engine = make_engine(resolve_db_url(settings), pool_size=POOL_SIZE)
    serving = ServingSync(settings, engine)
    stop = asyncio.Event()
    app.state.serving = serving
    follow = asyncio.create_task(serving.run(stop)) if settings.api.serve else None
    try:
        yield
    finally:
        stop.set()
        if follow is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await follow
        await serving.close()
        await engine.dispose()
