"""Serving test helpers: the API on a live local port, adapter versions as the trainer
publishes them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import uvicorn
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import lifecycle
from flywheel.adapters.factory import artifact_store
from flywheel.api.operator import operator_lifespan, operator_router
from flywheel.config import Settings
from flywheel.db.outbox import append_events
from flywheel.events import AdapterTrained, AdapterTrainedPayload
from flywheel.serving.lifespan import serving_lifespan
from flywheel.serving.responses_routes import responses_router
from flywheel.serving.routes import serving_router
from flywheel.stack.broker import free_port
from flywheel.web.app import create_app


@contextmanager
def live_api(settings: Settings, timeout_s: float = 60) -> Iterator[str]:
    """The operator and serving routes (chat, responses) with their real lifespan (the
    `ServingSync` that follows production and builds the configured engine) served by
    uvicorn on 127.0.0.1, in a thread; yields the base URL."""
    app = create_app(settings, routers=[operator_router(), serving_router(),
                                        responses_router()],
                     lifespan_hooks=[operator_lifespan, serving_lifespan])
    with served(app, timeout_s) as url:
        yield url


@contextmanager
def served(app: Any, timeout_s: float = 60) -> Iterator[str]:
    """An ASGI app served by uvicorn on a free 127.0.0.1 port, in a thread, with its
    lifespan; yields the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="flywheel-test-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the API did not start on port {port}")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


async def register_version(settings: Settings, engine: AsyncEngine, version: int,
                           source: Path | None, *, stage: Literal["sft", "grpo"] = "sft"
                           ) -> None:
    """What the trainer does: publish `source` to the artifact store (skipped when None: a
    version registered without an artifact) and record `AdapterTrained`."""
    store = artifact_store(settings)
    path = store.publish(settings.policy, version, source, base_model="smollm2",
                         steps=1, stage=stage).path if source is not None else Path("/missing")
    event = AdapterTrained(aggregate_id=f"{settings.policy}@v{version}",
                           payload=AdapterTrainedPayload(
                               policy=settings.policy, version=version, parent_version=None,
                               path=str(path), stage=stage, steps=1, groups=0,
                               stale_dropped=0, metrics={}))
    async with engine.begin() as conn:
        await lifecycle.project(conn, event)
        await append_events(conn, [event], settings.topics)
