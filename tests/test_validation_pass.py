"""The validation split and pass on real Postgres, with sampling replaced by a script (no
model): the split is stratified, sticky and refused by every training path; each published
version is scored once (cached); a run whose training reward rises while validation stays
flat proposes nothing, reports overfitting and pauses sampling; one whose validation rises
proposes its best version, and the gate's record says how it was selected."""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from consumers.scheduler import schedule_once
from flywheel.adapters import lifecycle, registry
from flywheel.config import Settings
from flywheel.db.outbox import append_events
from flywheel.demo.samples import TOOLS
from flywheel.events import AdapterTrained, AdapterTrainedPayload, Event
from flywheel.gate.decision import Attempt, EvalRun
from flywheel.gate.evaluate import Holdout, task_groups
from flywheel.mining.store import HoldoutRefused, store_task, training_tasks
from flywheel.policy.base import AdapterRef
from flywheel.rollout.store import candidate_stats
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec
from flywheel.trainer import store as trainer_store
from flywheel.validation import scoring, split
from flywheel.validation import store as vstore

pytestmark = [pytest.mark.postgres]


class FakeFormat:
    version = "fake-format.v1"


class FakePolicy:
    chat_format = FakeFormat()

    async def ensure_adapter(self, adapter: AdapterRef) -> None:
        pass


class Script:
    """Stands in for the gate's `evaluate`: version v solves the first `solved[v]` of the
    validation tasks (by task id); counts the passes sampled."""

    def __init__(self, solved: dict[int | None, int]) -> None:
        self.solved, self.calls = solved, []  # type: ignore[var-annotated]

    async def __call__(self, policy: Any, holdout: Holdout, adapter: AdapterRef | None,
                       settings: Settings, round_: int = 0, on_task: Any = None) -> EvalRun:
        version = adapter.version if adapter else None
        self.calls.append(version)
        tasks = sorted(holdout.tasks, key=lambda t: str(t.task_id))
        attempts = [Attempt(str(t.task_id), 0, i < self.solved[version], float(
            i < self.solved[version]), False, False, 10.0, 5) for i, t in enumerate(tasks)]
        return EvalRun(version, {str(t.task_id): task_groups(t) for t in tasks}, attempts)


def _ref(version: int | None) -> Any:
    async def go() -> AdapterRef | None:
        return None if version is None else AdapterRef("policy", version, Path("/x"))
    return go()


async def _pool(engine: AsyncEngine, s: Settings, n: int = 60, tag: str = "") -> None:
    """`n` train tasks over three failure modes and two tools, and a few holdout ones."""
    async with engine.begin() as conn:
        for i in range(n + 6):
            tool = "get_weather" if i % 2 else "search_flights"
            task = TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                            messages=[{"role": "user", "content": f"request {tag}{i}"}],
                            verifier=ToolCallSpec(expected=ExpectedCall(
                                name=tool, arguments={"city": f"c{i}"})),
                            failure_mode=["bad_arguments", "wrong_tool", "incomplete"][i % 3],
                            fingerprint=f"fp{tag}{i}", split="holdout" if i >= n else "train")
            await store_task(conn, task, uuid.uuid4(), "human_correction", s.topics)


async def _publish(engine: AsyncEngine, s: Settings, version: int, train_reward: float | None,
                   task: uuid.UUID) -> AdapterTrainedPayload:
    """Register version `version` (v1 = SFT, proposed; GRPO ones are snapshots) with one
    trained group of mean reward `train_reward`."""
    payload = AdapterTrainedPayload(
        policy="policy", version=version, parent_version=version - 1 or None,
        path=f"/adapters/v{version}", stage="sft" if train_reward is None else "grpo",
        steps=version, groups=1, stale_dropped=0, metrics={}, gate=train_reward is None)
    event = AdapterTrained(aggregate_id=f"policy@v{version}", payload=payload)
    async with engine.begin() as conn:
        await lifecycle.project(conn, event)
        await append_events(conn, [event], s.topics)
        if train_reward is not None:
            await conn.execute(text("""INSERT INTO rollout_groups (group_id, task_id,
                adapter_version, env, scored, not_run, reward_mean, reward_std, success_rate,
                trainable, rollouts, worker, duration_ms, trained_version, consumed_as,
                trained_at)
                VALUES (:g, :t, :v, 'tool_call', 8, 0, :r, 0.3, :r, true, '[]', 'w', 1, :v,
                        'trained', now())"""),
                {"g": uuid.uuid4(), "t": task, "v": version, "r": train_reward})
    return payload


def _settings(settings: Settings) -> Settings:
    return settings.model_copy(update={
        "policy": "policy",
        "trainer": settings.trainer.model_copy(update={"stages": "grpo_only"}),
        "validation": settings.validation.model_copy(update={"min_tasks": 8})})


async def _run(engine: AsyncEngine, s: Settings, monkeypatch: pytest.MonkeyPatch,
               solved: dict[int | None, int], rewards: list[float]
               ) -> tuple[list[Event], Script]:
    script = Script(solved)
    monkeypatch.setattr(scoring, "evaluate", script)
    vp = scoring.ValidationPass(s, engine, FakePolicy())  # type: ignore[arg-type]
    monkeypatch.setattr(type(vp.adapters), "__call__", lambda self, v: _ref(v))
    async with engine.connect() as conn:
        train = [t.task_id for t in await training_tasks(conn, limit=1)]
    events: list[Event] = []
    events += await vp.on_trained(await _publish(engine, s, 1, None, train[0]))
    async with engine.begin() as conn:  # the gate turned the SFT version down
        await lifecycle.reject_unevaluated(conn, "policy", 1, actor="gate", reason="test",
                                           topics=s.topics)
    for n, r in enumerate(rewards):
        events += await vp.on_trained(await _publish(engine, s, n + 2, r, train[0]))
    return events, script


async def test_the_split_is_stratified_sticky_and_refused_by_training(
        engine: AsyncEngine, settings: Settings) -> None:
    s = _settings(settings)
    await _pool(engine, s)
    async with engine.begin() as conn:
        assert await split.assign(conn, s.validation) == 9  # ceil(15% of 60)
        assert await split.assign(conn, s.validation) == 0  # sticky: nothing moves
        strata = (await conn.execute(text(
            "SELECT stratum, count(*) FROM validation_tasks GROUP BY 1"))).all()
        val = set((await conn.execute(text("SELECT task_id FROM validation_tasks"))).scalars())
        splits = set((await conn.execute(text("SELECT DISTINCT t.split FROM validation_tasks "
                                              "JOIN tasks t USING (task_id)"))).scalars())
    assert splits == {"train"}  # never a holdout task
    assert len(strata) == 6 and all(c in (1, 2) for _, c in strata)  # 6 strata of 10 tasks
    async with engine.connect() as conn:
        from flywheel.mining.queries import get_task, list_tasks

        listed = await list_tasks(conn, split="validation", limit=100)  # `flywheel tasks ls`
        assert {uuid.UUID(r["task_id"]) for r in listed} == val
        assert (await get_task(conn, next(iter(val))) or {})["split"] == "validation"
        assert len(await list_tasks(conn, split="train", limit=100)) == 51
        picked = {t.task_id for t in await candidate_stats(conn)}
        assert picked and not picked & val  # the scheduler never requests them
        assert not {t.task_id for t in await training_tasks(conn, limit=1000)} & val
        with pytest.raises(HoldoutRefused, match="validation"):
            await training_tasks(conn, task_ids=[next(iter(val))])
        assert await trainer_store.validation_tasks_among(conn, list(val)) == val
        assert await trainer_store.validation_selects(conn, s.validation, s.rollout.envs)


async def test_flat_validation_with_rising_training_reward_proposes_nothing_and_pauses(
        engine: AsyncEngine, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _settings(settings)
    await _pool(engine, s)
    async with engine.begin() as conn:
        await split.assign(conn, s.validation)
    solved = dict.fromkeys([None, 1, 2, 3, 4, 5, 6, 7], 4)  # 4 of 9, whatever the training
    events, script = await _run(engine, s, monkeypatch, solved,
                                [0.37, 0.5, 0.62, 0.74, 0.85, 0.86])
    types = [e.type for e in events]
    assert "CandidateProposed" not in types
    assert types.count("OverfittingDetected") == 1  # once, not at every later version
    alarm = next(e for e in events if e.type == "OverfittingDetected")
    assert alarm.payload.action == "pause_for_tasks"  # type: ignore[union-attr]
    assert types.count("ValidationScored") == 7
    # Production (the base model) was scored once, then read from the cache.
    assert script.calls.count(None) == 1
    async with engine.connect() as conn:
        st = await vstore.status(conn, "policy")
        curve = await vstore.curve_rows(conn, "policy")
        statuses = set((await conn.execute(text(
            "SELECT status FROM adapter_versions WHERE stage = 'grpo'"))).scalars())
    assert st is not None and st["state"] == "overfitting"
    assert statuses == {"snapshot"}
    v7 = next(r for r in curve if r["version"] == 7)
    assert abs(v7["gap"] - (0.86 - 4 / 9)) < 1e-9
    # Status and /metrics say so; the trainer's own state too.
    from flywheel.api.metrics import families, snapshot
    from flywheel.observe.status import counts

    async with engine.connect() as conn:
        data = await counts(conn, "policy")
        found = {f.name: f for f in families(await snapshot(conn, s), {}, None)}
        assert await trainer_store.overfitting(conn, "policy") == st["detail"]
    assert data["validation"]["state"] == "overfitting" and data["validation"]["tasks"] == 9
    assert data["tasks_by_split"] == {"train": 51, "validation": 9, "holdout": 6}
    state = {sm.labels["state"]: sm.value for sm in found["flywheel_validation_state"].samples}
    assert state == {"absent": 0, "ok": 0, "overfitting": 1}
    assert found["flywheel_validation_gap"].samples[0].value == pytest.approx(0.86 - 4 / 9)
    # The pause: the scheduler requests nothing until the miner adds tasks.
    rng = random.Random(0)
    assert await schedule_once(engine, s, rng) == 0
    await _pool(engine, s, n=s.validation.resume_new_tasks, tag="more")
    assert await schedule_once(engine, s, rng) > 0
    async with engine.connect() as conn:
        st = await vstore.status(conn, "policy")
    assert st is not None and st["state"] == "ok" and st["after_version"] == 7


async def test_rising_validation_proposes_the_best_version_and_the_gate_records_it(
        engine: AsyncEngine, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _settings(settings)
    await _pool(engine, s)
    async with engine.begin() as conn:
        await split.assign(conn, s.validation)
    solved = {None: 3, 1: 3, 2: 3, 3: 8, 4: 7}  # production: the base model
    events, _ = await _run(engine, s, monkeypatch, solved, [0.4, 0.5, 0.55])
    proposals = [e for e in events if e.type == "CandidateProposed"]
    assert [p.payload.version for p in proposals] == [3]  # type: ignore[union-attr]
    p = proposals[0].payload
    assert p.production_version is None and p.tasks == 9  # type: ignore[union-attr]
    async with engine.connect() as conn:
        assert await registry.version_status(conn, "policy", 3) == "candidate"
        assert await registry.version_status(conn, "policy", 4) == "snapshot"
        how = await registry.selected_by(conn, "policy", 3)
        assert how.startswith("validation: v3") and "p 0.031" in how  # 5 wins: 1/32
        assert (await registry.selected_by(conn, "policy", 1)).startswith("trainer: the SFT")
        sel = (await conn.execute(text("SELECT selection FROM candidate_selections"))).scalar()
    assert json.loads(json.dumps(sel))["considered"] == [2, 3]
    # The gate takes the proposal up, samples only the holdout, and says how it was chosen.
    from flywheel.gate import candidate as gate_service
    from flywheel.mining.store import freeze_eval_set

    async with engine.begin() as conn:
        await freeze_eval_set(conn, s.topics)
    holdout_seen: list[set[str]] = []

    async def gate_sample(policy: Any, holdout: Holdout, adapter: AdapterRef | None,
                          settings: Settings, round_: int = 0, on_task: Any = None) -> EvalRun:
        holdout_seen.append({str(t.task_id) for t in holdout.tasks})
        return await Script({None: 1, 3: 5})(policy, holdout, adapter, settings, round_)

    async def probe(*args: Any) -> tuple[list[float], list[float]]:
        return [10.0], [10.0]

    monkeypatch.setattr(gate_service, "evaluate", gate_sample)
    monkeypatch.setattr(gate_service, "probe_latency", probe)
    gate = gate_service.GateService(s, engine, FakePolicy())  # type: ignore[arg-type]
    monkeypatch.setattr(type(gate.adapters), "__call__", lambda self, v: _ref(v))
    decided = await gate.on_proposed(proposals[0].payload)  # type: ignore[arg-type]
    record = decided[0].payload
    assert record.selected_by is not None  # type: ignore[union-attr]
    assert record.selected_by.startswith("validation: v3")  # type: ignore[union-attr]
    async with engine.connect() as conn:
        val = {str(t) for t in (await conn.execute(text(
            "SELECT task_id FROM validation_tasks"))).scalars()}
    assert holdout_seen and all(not seen & val for seen in holdout_seen)
    assert await gate.on_proposed(proposals[0].payload) == []  # type: ignore[arg-type]
    # Replaying the log rebuilds the candidate and its selection.
    async with engine.begin() as conn:
        before = await lifecycle.snapshot(conn)
        await lifecycle.replay(conn)
        after = await lifecycle.snapshot(conn)
    for table in ("adapter_versions", "candidate_selections"):
        assert after[table] == before[table]


async def test_the_trainer_refuses_a_group_of_a_validation_task(
        engine: AsyncEngine, settings: Settings) -> None:
    from aiokafka import TopicPartition

    from flywheel.events import GroupScoredPayload
    from flywheel.trainer.learner import TrainerService, _Pending

    s = _settings(settings)
    await _pool(engine, s)
    async with engine.begin() as conn:
        await split.assign(conn, s.validation)
        val = (await conn.execute(text("SELECT task_id FROM validation_tasks"))).scalars().first()
        train = (await training_tasks(conn, limit=1))[0].task_id
        ids = [uuid.uuid4(), uuid.uuid4()]
        for gid, task in zip(ids, [val, train], strict=True):
            await conn.execute(text("""INSERT INTO rollout_groups (group_id, task_id, env,
                scored, not_run, reward_mean, reward_std, success_rate, trainable, rollouts,
                worker, duration_ms) VALUES (:g, :t, 'tool_call', 8, 0, 0.5, 0.5, 0.5, true,
                '[]', 'w', 1)"""), {"g": gid, "t": task})
    groups = [GroupScoredPayload(group_id=gid, task_id=task, env="tool_call", adapter=None,
                                 adapter_version=None, temperature=1.0, rollouts=[],
                                 reward_mean=0.5, reward_std=0.5, trainable=True, worker="w")
              for gid, task in zip(ids, [val, train], strict=True)]
    svc = TrainerService(s, engine)
    tp = TopicPartition("t", 0)
    refused = await svc._refuse_validation([_Pending(tp, n, g) for n, g in enumerate(groups)])
    assert refused == {val}
    async with engine.connect() as conn:
        consumed = dict((await conn.execute(text(
            "SELECT group_id, consumed_as FROM rollout_groups"))).all())
    assert consumed == {ids[0]: "validation", ids[1]: None}


async def test_with_yield_to_gate_a_pass_waits_for_the_gates_evaluation(
        engine: AsyncEngine, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from flywheel.gate.progress import write_status

    s = _settings(settings)
    s = s.model_copy(update={"rollout": s.rollout.model_copy(update={"yield_to_gate": True})})
    await _pool(engine, s)
    async with engine.begin() as conn:
        await split.assign(conn, s.validation)
        train = [t.task_id for t in await training_tasks(conn, limit=1)]
        await write_status(conn, s.policy, state="evaluating", version=7)
    script = Script({None: 3, 1: 3, 2: 3})
    monkeypatch.setattr(scoring, "evaluate", script)
    monkeypatch.setattr(scoring, "GATE_POLL_S", 0.05)
    vp = scoring.ValidationPass(s, engine, FakePolicy())  # type: ignore[arg-type]
    monkeypatch.setattr(type(vp.adapters), "__call__", lambda self, v: _ref(v))
    scored = asyncio.create_task(vp.on_trained(await _publish(engine, s, 1, None, train[0])))
    await asyncio.sleep(0.5)
    assert script.calls == [] and not scored.done()  # the decision has the cores
    async with engine.begin() as conn:
        await write_status(conn, s.policy, state="idle")
    events = await asyncio.wait_for(scored, 10)
    assert script.calls == [1] and [e.type for e in events] == ["ValidationScored"]

    # A gate whose heartbeat is stale (stopped) holds nothing; nor does a pass without the
    # setting, whatever the gate does.
    async with engine.begin() as conn:
        await write_status(conn, s.policy, state="evaluating", version=8)
        await conn.execute(text("UPDATE gate_status SET updated_at = now() - interval '1 hour'"))
    await asyncio.wait_for(vp.on_trained(await _publish(engine, s, 2, 0.5, train[0])), 10)
    assert script.calls[:2] == [1, 2]  # v2 at once (then production, for the screen)
