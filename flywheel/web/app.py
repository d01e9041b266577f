"""The HTTP API app factory: settings on `app.state`, `/healthz`, routers, their resources.

Features live in routers built elsewhere (the trajectory gateway in `flywheel.api.gateway`, …).
A router that needs a long-lived resource (a Kafka producer, a DB engine) ships a *lifespan
hook*: a function `app -> async context manager` that opens the resource on entry, keeps it
on `app.state`, and closes it on exit. `create_app` enters the hooks in order at startup and
exits them in reverse order at shutdown.

Every app gets `/healthz` and `/readyz` (`flywheel.web.health`) and the guard
(`flywheel.web.guards`: the request-body limit, 503 for a dependency that is down, a JSON
500 as the last resort), so no route can be added without them.

Importing this module is cheap: no torch, no Kafka client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager

from fastapi import APIRouter, FastAPI, Request

from flywheel import __version__
from flywheel.config import Settings
from flywheel.web import guards
from flywheel.web.health import health_router

LifespanHook = Callable[[FastAPI], AbstractAsyncContextManager[None]]
"""Opens a resource for the app's lifetime; see the module docstring."""


def create_app(settings: Settings, *, routers: Sequence[APIRouter] = (),
               lifespan_hooks: Sequence[LifespanHook] = ()) -> FastAPI:
    """A FastAPI app serving `routers`, with `lifespan_hooks` run around its lifetime."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The exit stack closes what was opened, in reverse, also when a later hook fails.
        async with AsyncExitStack() as stack:
            for hook in lifespan_hooks:
                await stack.enter_async_context(hook(app))
            yield

    app = FastAPI(title="Flywheel", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.probes = {}
    app.include_router(health_router())
    for router in routers:
        app.include_router(router)
    guards.install(app, settings.api.max_request_bytes)
    return app


def settings_of(source: Request | FastAPI) -> Settings:
    """The `Settings` the app (or the app serving a request) was created with."""
    app: FastAPI = source.app if isinstance(source, Request) else source
    settings: Settings = app.state.settings
    return settings
