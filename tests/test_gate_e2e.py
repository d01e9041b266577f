"""The gate end to end on the real broker + Postgres with the local engine.

A published adapter version travels trainer-style (store → `AdapterTrained` through the
outbox and the relay) to the gate process, which samples candidate and production on the
frozen holdout and records its decision; auto mode promotes, manual mode waits for an
operator; a rollback moves production back and the serving alias follows; replay rebuilds
the identical state. The adapters here are fresh LoRA (equal to the base model), so the rule
is loosened to let them through: this test is about the machinery; the decision rule itself
is tested on hand-built runs in test_gate_decision.py.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text

from flywheel.adapters import lifecycle, registry
from flywheel.adapters.local import AdapterStore
from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.db.outbox import append_events
from flywheel.demo.samples import TOOLS
from flywheel.events import AdapterTrained, AdapterTrainedPayload
from flywheel.gate.candidate import GateService
from flywheel.mining.store import freeze_eval_set, store_task
from flywheel.policy.local import LocalPolicy
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.runtime.kafka import ensure_topics
from flywheel.serving.completions import complete
from flywheel.serving.request import parse_request
from flywheel.serving.sync import ServingSync
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec
from tests.support.helpers import machinery_gate, spawn, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.postgres]


def _holdout(city: str) -> TaskSpec:
    return TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                    messages=[{"role": "user", "content": f"Weather in {city}, in celsius?"}],
                    verifier=ToolCallSpec(expected=ExpectedCall(
                        name="get_weather", arguments={"city": city, "unit": "c"})),
                    failure_mode="bad_arguments", fingerprint=f"hold-{city}", split="holdout")


async def _publish_version(settings: Settings, store: AdapterStore, version: int,
                           work: Path) -> None:
    """What the trainer does: save, publish atomically, register, emit AdapterTrained."""
    from flywheel.trainer.engine import LoRASpec, LoRATrainer
    from flywheel.trainer.grpo import GRPOConfig

    trainer = await asyncio.to_thread(LoRATrainer, resolve_model_dir(None),
                                      lora=LoRASpec(r=4), grpo=GRPOConfig(), lr=1e-4)
    await asyncio.to_thread(trainer.save, work / f"v{version}")
    ref = store.publish(settings.policy, version, work / f"v{version}",
                        base_model="smollm2", steps=version, parent_version=version - 1 or None)
    event = AdapterTrained(aggregate_id=ref.name, payload=AdapterTrainedPayload(
        policy=settings.policy, version=version, parent_version=version - 1 or None,
        path=str(ref.path), stage="grpo", steps=version, groups=0, stale_dropped=0,
        metrics={}))
    engine = make_engine(settings.db.url or "")
    async with engine.begin() as conn:
        await lifecycle.project(conn, event)
        await append_events(conn, [event], settings.topics)
    await engine.dispose()


def _gate_settings(settings: Settings, mode: str, tmp_path: Path) -> Settings:
    return settings.model_copy(update={
        "gate": machinery_gate(settings.gate, mode=mode, samples_per_task=2),
        "rollout": settings.rollout.model_copy(update={
            "max_tokens": 24, "model_dir": resolve_model_dir(None)}),
        "trainer": settings.trainer.model_copy(update={"adapters_dir": tmp_path / "adapters"}),
        "api": settings.api.model_copy(update={"serve": True})})


async def test_gate_promotes_waits_for_approval_rolls_back_and_replays(
        settings: Settings, db_url: str, pg_dsn: str, tmp_path: Path) -> None:
    s = _gate_settings(settings, "auto", tmp_path)
    assert s.kafka.bootstrap
    await ensure_topics(s.kafka.bootstrap, s.topics.all(), partitions=1)
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        for city in ("Oslo", "Lima", "Pune"):
            await store_task(conn, _holdout(city), uuid.uuid4(), "human_correction",
                             s.topics)
        await freeze_eval_set(conn, s.topics)
    store = AdapterStore(tmp_path / "adapters")
    procs = [spawn("producers.relay", s, tmp_path / "relay.log"),
             spawn("consumers.gate", s, tmp_path / "gate.log")]
    try:
        await _publish_version(s, store, 1, tmp_path / "work")
        promoted = await wait_for(pg_dsn, "SELECT count(*) FROM production WHERE version = 1",
                                  1, timeout=240)
        assert promoted == 1, (tmp_path / "gate.log").read_text()[-3000:]
        async with engine.connect() as conn:
            record = (await conn.execute(text("""SELECT record FROM evaluations
                WHERE version = 1"""))).scalar_one()
        assert record["mode"] == "auto" and record["baseline_version"] is None
        assert record["candidate"]["samples"] + record["candidate"]["not_run"] == 6
        assert record["baseline"]["tasks"] == 3 and record["reasons"]
        # One round (k = 2 in rounds of 2), looked at by the sequential test; latency from
        # the paired probe; what the eval set could see, from the pairs it observed.
        assert record["sequential"]["stop"] == "win" and len(record["sequential"]["rounds"]) == 1
        assert record["latency"] == "paired_probe" and record["latency_probe"]["pairs"] == 1
        assert record["power"]["tasks"] == 3 and record["power"]["pairs"] == 6
        runs = await wait_for(pg_dsn, "SELECT count(*) FROM eval_runs", 2, timeout=5)
        assert runs == 2  # base model (the baseline's round) and candidate, cached per round
        assert await wait_for(pg_dsn, "SELECT count(*) FROM gate_status WHERE state = 'idle' "
                              "AND power IS NOT NULL", 1, timeout=120) == 1, \
            (tmp_path / "gate.log").read_text()[-3000:]
        async with engine.connect() as conn:
            gate = await registry.gate_activity(conn, s.policy)
        assert gate is not None and gate["power"]["tasks"] == 3
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)

    # Manual mode: the gate recommends, production waits for an operator.
    manual = _gate_settings(settings, "manual", tmp_path)
    await _publish_version(manual, store, 2, tmp_path / "work")
    policy = LocalPolicy(resolve_model_dir(None))
    try:
        gate = GateService(manual, engine, policy)
        (evaluated,) = await gate.evaluate_version(2)
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT version FROM production"))).scalar() == 1
        async with engine.begin() as conn:
            await lifecycle.approve(conn, evaluated.payload.evaluation_id,  # type: ignore
                                    actor="alice", reason="reviewed", topics=s.topics)

        # Serving follows production: v2, then back to v1 after the rollback.
        serving = ServingSync(manual, engine, policy)
        assert await serving.sync_once()
        request = parse_request(json.dumps({
            "model": "production", "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say hi"}]}).encode())
        assert (await complete(serving, request))["model"] == "policy@v2"
        async with engine.begin() as conn:
            back = await lifecycle.rollback(conn, "policy", to=None, actor="bob",
                                            reason="regressed", topics=s.topics)
        assert back.payload.to_version == 1
        assert await serving.sync_once()
        answer = await complete(serving, request)
        assert answer["model"] == "policy@v1" and answer["usage"]["completion_tokens"] > 0
        async with engine.connect() as conn:
            state = (await conn.execute(text("SELECT version, replicas FROM serving_state")
                                        )).one()
        assert tuple(state) == (1, ["local"])
    finally:
        await policy.close()

    async with engine.begin() as conn:
        before = await lifecycle.snapshot(conn)
        replayed = await lifecycle.replay(conn)
        after = await lifecycle.snapshot(conn)
    await engine.dispose()
    assert after == before and replayed >= 8
    assert [r["status"] for r in after["adapter_versions"]] == ["promoted", "rolled_back"]
