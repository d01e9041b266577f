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
from flywheel.trainer.learner import TrainerService

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


async def _gate_row(engine: Any, state: str, age_s: float = 0.0) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("""INSERT INTO gate_status (policy, state, started_at,
            updated_at, samples_done, samples_planned)
            VALUES ('policy', :s, now(), now() - make_interval(secs => :age), 12, 40)
            ON CONFLICT (policy) DO UPDATE SET state = :s,
                updated_at = now() - make_interval(secs => :age)"""),
            {"s": state, "age": age_s})


async def test_baseline_wait_outlasts_its_deadline_while_one_is_in_progress(
        settings: Settings, db_url: str) -> None:
    import asyncio

    from flywheel.events import GateMetrics
    from flywheel.gate.baseline import store_baseline

    s = settings.model_copy(update={"trainer": settings.trainer.model_copy(
        update={"baseline_wait_s": 0.5})})
    engine = make_engine(db_url)
    service = TrainerService(s, engine)
    await _gate_row(engine, "baseline")
    waiting = asyncio.create_task(service._wait_for_baseline())
    await asyncio.sleep(3.0)  # six times the deadline
    assert not waiting.done()
    assert "in progress" in (service.status.detail or "")
    assert "12/40 samples" in (service.status.detail or "")
    base = GateMetrics(version=None, tasks=10, samples=40, not_run=0, success_rate=0.0,
                       mean_reward=0.0, invalid_rate=0.9, unsafe_rate=0.0,
                       latency_mean_ms=1.0, latency_p95_ms=1.0, tokens_per_task=1.0,
                       groups={}, group_samples={})
    async with engine.begin() as conn:
        await store_baseline(conn, "policy", 1, base, None, s.gate)
    found = await asyncio.wait_for(waiting, 10)
    assert found is not None and found["recommendation"] == "sft"

    # A gate that stopped mid-baseline (stale heartbeat) is not waited for.
    async with engine.begin() as conn:
        await conn.execute(text("DELETE FROM baselines"))
    await _gate_row(engine, "baseline", age_s=600)
    assert await asyncio.wait_for(service._wait_for_baseline(), 10) is None
    await service.warm_start()  # no baseline: GRPO from the base model, and it says so
    _, detail = service.watch()
    assert "no baseline after 0s and none in progress" in (detail or "")
    await engine.dispose()


async def test_grpo_versions_are_proposed_to_the_gate_only_when_worth_evaluating(
        settings: Settings, db_url: str) -> None:
    from flywheel.trainer import store

    s = settings.model_copy(update={"trainer": settings.trainer.model_copy(
        update={"propose_min_groups": 16})})
    engine = make_engine(db_url)
    service = TrainerService(s, engine)

    async def version(v: int, status: str, groups: int) -> None:
        async with engine.begin() as conn:
            await conn.execute(text("""INSERT INTO adapter_versions (policy, version, path,
                status, groups) VALUES ('policy', :v, '/x', :s, :g)"""),
                {"v": v, "s": status, "g": groups})

    await version(1, "promoted", 0)      # the SFT warm start, decided
    await version(2, "snapshot", 8)      # sampled, not gated
    async with engine.connect() as conn:
        assert await store.groups_since_candidate(conn, "policy") == 8
    service.groups_since_candidate = 8
    service.trained = [object()] * 4  # type: ignore[list-item]  # 4 groups in this version
    assert not await service._propose()  # 12 < 16 new groups: near-identical to v1
    service.trained = [object()] * 8  # type: ignore[list-item]
    assert await service._propose()  # 16 groups, nothing waiting for the gate
    await version(3, "candidate", 8)     # still waiting for the gate
    assert not await service._propose()
    async with engine.connect() as conn:
        assert await store.groups_since_candidate(conn, "policy") == 0
    zero = TrainerService(s.model_copy(update={"trainer": s.trainer.model_copy(
        update={"propose_min_groups": 0})}), engine)
    assert await zero._propose()  # every version proposed (the gate skips superseded ones)
    await engine.dispose()


class Seeks(Commits):
    """Commits, and the consumer's seeks (a rewind)."""

    def __init__(self) -> None:
        super().__init__()
        self.seeks: list[tuple[TopicPartition, int]] = []

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))


async def test_transient_failures_never_skip_nor_stall_the_commit(
        settings: Settings, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from flywheel.events import AdapterRejected, AdapterRejectedPayload

    s = settings.model_copy(update={"rollout": settings.rollout.model_copy(
        update={"train_batch_groups": 2})})
    engine = make_engine(db_url)
    service = TrainerService(s, engine)
    task = uuid.uuid4()
    other = AdapterRejected(aggregate_id="x", payload=AdapterRejectedPayload(
        policy="p", version=1, evaluation_id=None, actor="gate", reason="no"))
    fetch = [Record("r", 0, 0, other.model_dump_json().encode()),
             *[Record("r", 0, i, GroupScored(aggregate_id="x", payload=_group(task, None))
                      .model_dump_json().encode()) for i in (1, 2)]]

    # Postgres refuses while the fetch is taken: rewound to its first record, nothing
    # committed, nothing kept (it is fetched again).
    async def refused(ids: list[uuid.UUID]) -> set[uuid.UUID]:
        raise ConnectionRefusedError("postgres is restarting")

    monkeypatch.setattr(service, "_already_consumed", refused)
    consumer = Seeks()
    with pytest.raises(ConnectionRefusedError):
        await service.on_records(fetch, consumer)
    assert consumer.seeks == [(TopicPartition("r", 0), 0)] and consumer.calls == []
    assert service.batch == []
    monkeypatch.undo()

    # Fetched again; the step fails transiently: its groups wait for the next fetch, and the
    # record that needed nothing is committed now (the commit does not stall behind it).
    async def no_refusal(items: list[Any]) -> set[uuid.UUID]:
        return set()

    async def outage(chunk: list[Any]) -> None:
        raise ConnectionRefusedError("postgres is restarting")

    monkeypatch.setattr(service, "_refuse_validation", no_refusal)
    monkeypatch.setattr(service, "_step", outage)
    with pytest.raises(ConnectionRefusedError):
        await service.on_records(fetch, consumer)
    assert [p.offset for p in service.batch] == [1, 2]
    assert consumer.calls == [{TopicPartition("r", 0): 1}]
    await engine.dispose()


async def test_a_holdout_with_no_eval_set_is_named_where_the_user_looks(
        settings: Settings, db_url: str) -> None:
    """Holdout tasks mined but no eval set frozen: nothing is decided and the first training
    waits; `flywheel status` (the gate's warning) and the trainer's status say what to run,
    not only the gate's log. Once frozen, neither says it."""
    import asyncio

    from flywheel.mining.store import freeze_eval_set
    from flywheel.observe.status import counts

    task = TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                    messages=[{"role": "user", "content": "Weather in Pune?"}],
                    verifier=ToolCallSpec(expected=ExpectedCall(name="get_weather",
                                                                arguments={"city": "Pune"})),
                    failure_mode="bad_arguments", fingerprint="fp-pune", split="holdout")
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        await store_task(conn, task, uuid.uuid4(), "human_correction", settings.topics)
        warning = (await counts(conn, settings.policy))["gate"]["warning"]
    assert "`flywheel evalset freeze`" in warning and "(1 tasks now)" in warning
    s = settings.model_copy(update={"trainer": settings.trainer.model_copy(
        update={"baseline_wait_s": 0.3})})
    service = TrainerService(s, engine)
    waiting = asyncio.create_task(service._wait_for_baseline())
    await asyncio.sleep(0.1)
    assert "no eval set is frozen yet: `flywheel evalset freeze`" in (service.status.detail
                                                                      or "")
    assert await asyncio.wait_for(waiting, 10) is None
    async with engine.begin() as conn:
        await freeze_eval_set(conn, settings.topics)
        assert (await counts(conn, settings.policy))["gate"]["warning"] is None
    waiting = asyncio.create_task(service._wait_for_baseline())
    await asyncio.sleep(0.1)
    assert "none in progress yet" in (service.status.detail or "")
    assert await asyncio.wait_for(waiting, 10) is None
    await engine.dispose()
