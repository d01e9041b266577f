"""Trainer service logic without a model: staleness drop, offsets, watchdog states."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from aiokafka import TopicPartition
from sqlalchemy import text

from flywheel.config import Settings, Topics
from flywheel.db.engine import make_engine
from flywheel.demo.samples import TOOLS
from flywheel.events import GroupScored, GroupScoredPayload, ScoredRollout
from flywheel.mining.store import store_task
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec
from flywheel.trainer.service import TrainerService

pytestmark = [pytest.mark.postgres]


@dataclass
class Record:
    topic: str
    partition: int
    offset: int
    value: bytes


class Commits:
    """Records explicit offset commits (the Kafka side is exercised in test_trainer.py)."""

    def __init__(self) -> None:
        self.calls: list[dict[TopicPartition, int]] = []

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.calls.append(dict(offsets))


def _group(task_id: uuid.UUID, version: int | None) -> GroupScoredPayload:
    rollouts = [ScoredRollout(index=i, reward=float(i % 2), reward_components={},
                              failure_mode=None, not_run=None, turns=[], latency_ms=1)
                for i in range(4)]
    return GroupScoredPayload(group_id=uuid.uuid4(), task_id=task_id, env="tool_call",
                              adapter=None, adapter_version=version, temperature=1.0,
                              rollouts=rollouts, reward_mean=0.5, reward_std=0.5,
                              trainable=True, worker="t")


async def test_stale_groups_are_dropped_recorded_and_committed(settings: Settings,
                                                               db_url: str, pg_dsn: str) -> None:
    s = settings.model_copy(update={"rollout": settings.rollout.model_copy(
        update={"max_staleness": 2, "train_batch_groups": 4})})
    engine = make_engine(db_url)
    task = TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                    messages=[{"role": "user", "content": "hi"}],
                    verifier=ToolCallSpec(expected=ExpectedCall(name="get_weather")),
                    failure_mode="other", fingerprint="stale", split="train")
    groups = [_group(task.task_id, v) for v in (1, 2, 4)]  # current version 5
    async with engine.begin() as conn:
        await store_task(conn, task, uuid.uuid4(), "test", Topics.for_prefix("t"))
        for g in groups:
            await conn.execute(text("""INSERT INTO rollout_groups (group_id, task_id, env,
                scored, not_run, trainable, rollouts, worker, duration_ms, adapter_version)
                VALUES (:g, :t, 'tool_call', 4, 0, true, '[]', 'w', 1, :v)"""),
                {"g": g.group_id, "t": task.task_id, "v": g.adapter_version})
    service = TrainerService(s, engine)
    service.version = 5
    commits = Commits()
    records = [Record("r", 0, i, GroupScored(aggregate_id="x", payload=g).model_dump_json()
                      .encode()) for i, g in enumerate(groups)]
    await service.on_records(records, commits)
    # v1 and v2 are > 2 versions old: dropped; v4 waits for a full batch.
    assert [p.group.adapter_version for p in service.batch] == [4]
    assert service.status.stale_dropped == 2
    assert commits.calls == [{TopicPartition("r", 0): 2}]  # never past the waiting group
    conn = await asyncpg.connect(pg_dsn)
    try:
        rows = dict(await conn.fetch("SELECT adapter_version, consumed_as FROM rollout_groups"))
    finally:
        await conn.close()
    assert rows == {1: "stale", 2: "stale", 4: None}
    await engine.dispose()


def test_watchdog_reports_starved_and_stalled(settings: Settings) -> None:
    s = settings.model_copy(update={"trainer": settings.trainer.model_copy(
        update={"starved_after_s": 5, "stalled_after_s": 60})})
    service = TrainerService(s, engine=Any)  # type: ignore[arg-type]
    service.status.state = "waiting"
    assert service.watch()[0] == "waiting"
    service.status.last_group_at = time.monotonic() - 10
    state, detail = service.watch()
    assert state == "starved" and "rollout workers" in (detail or "")
    service.status.state = "training"
    service.status.step_started_at = time.monotonic() - 120
    assert service.watch()[0] == "stalled"
