"""The first training's wait for the gate's baseline: never a silent fall-through.

The baseline (the base model on the frozen holdout) can take most of the trainer's wait on
a slow machine, so the wait keeps going past its deadline for as long as the gate reports a
baseline in progress (`gate_status`, with a live heartbeat); only with no baseline and none
in progress does it give up, and the caller says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import registry

log = logging.getLogger("flywheel.trainer")
POLL_S = 2.0


async def wait_for_baseline(engine: AsyncEngine, policy: str, wait_s: float,
                            report: Callable[[str], None]) -> dict[str, Any] | None:
    """The baseline once the gate recorded it; waits `wait_s` for one to appear, and past
    that for as long as the gate reports one in progress. `report` gets the progress in
    words (the trainer's status detail). None: no baseline, and none in progress."""
    started = time.monotonic()
    log.info("waiting for the gate's baseline on the frozen holdout (up to %.0fs, longer "
             "while one is in progress)", wait_s)
    while True:
        async with engine.connect() as conn:
            baseline = await registry.latest_baseline(conn, policy)
            gate = await registry.gate_activity(conn, policy)
            frozen = baseline is not None or await registry.newest_eval_set(conn) is not None
        if baseline is not None:
            return baseline
        waited = time.monotonic() - started
        if gate is not None and gate["state"] == "baseline":
            report(f"waiting for the gate's baseline, in progress for "
                   f"{gate['elapsed_s'] or 0:.0f}s ({gate['samples_done']}/"
                   f"{gate['samples_planned']} samples)")
        elif waited >= wait_s:
            return None
        else:
            why = ("no eval set is frozen yet: `flywheel evalset freeze`" if not frozen
                   else "none in progress yet"
                   + ("" if gate is None else ", gate " + gate["state"]))
            report(f"waiting for the gate's baseline ({waited:.0f}s; {why}; gives up at "
                   f"{wait_s:.0f}s)")
        await asyncio.sleep(POLL_S)
