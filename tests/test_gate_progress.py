"""Progress moves task by task: inside a round, the samples each finished task brings show in
the status row with the next heartbeat, before the round ends."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import registry
from flywheel.gate import progress as gate_progress

pytestmark = [pytest.mark.postgres]


async def test_samples_done_moves_within_a_round(engine: AsyncEngine,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gate_progress, "HEARTBEAT_S", 0.05)
    progress = gate_progress.Progress(engine, "policy")

    async def done() -> int:
        async with engine.connect() as conn:
            row = await registry.gate_activity(conn, "policy")
        assert row is not None
        return int(row["samples_done"])

    async with progress.activity("baseline", rounds_planned=2, samples_planned=40):
        progress.task_done(2)
        progress.task_done(2)
        await asyncio.sleep(0.3)
        assert await done() == 4  # two tasks of round 1 done, the round not yet
        await progress.round_done(1, "round 1")
        assert await done() == 4
    async with progress.activity("evaluating", rounds_planned=1, samples_planned=8):
        assert await done() == 0 and progress.samples == 0  # a new activity starts at 0
