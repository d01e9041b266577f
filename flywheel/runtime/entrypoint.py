"""Process entry points shared by every service module (logging, signals, shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

from faststream import FastStream

from flywheel.config import Settings
from flywheel.runtime.logs import configure_logging

LOG_FORMAT = "%(asctime)s %(name)s %(message)s"


def run_faststream(build_app: Callable[[Settings], FastStream]) -> None:
    """`main()` of a FastStream service: settings from the environment, run until SIGTERM."""
    configure_logging(logging.INFO, LOG_FORMAT)
    asyncio.run(build_app(Settings()).run())


def run_loop(loop_fn: Callable[[Settings, asyncio.Event], Awaitable[None]]) -> None:
    """`main()` of a polling service: `loop_fn` runs until SIGTERM/SIGINT sets its event."""
    configure_logging(logging.INFO, LOG_FORMAT)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await loop_fn(Settings(), stop)

    asyncio.run(runner())


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel a service's background tasks and wait until each has stopped."""
    for t in tasks:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t


async def pause(stop: asyncio.Event, seconds: float) -> None:
    """Sleep up to `seconds`, returning early when `stop` is set."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass
