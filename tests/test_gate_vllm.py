"""The gate and the serving switch through a real vLLM server (the `vllm` tests).

The gate (`GateService`) evaluates a candidate on a tiny frozen holdout with the vLLM engine;
serving (`ServingSync`) then moves the `production` alias to it on every replica — load,
`/v1/models` check, `ServingSwitched` — to the next version, and back on a rollback. Two
replica addresses of the session's server (tests/support/vllm_server.py `Proxy`): each is loaded and
checked on its own. The decision rule is loosened as in test_gate_e2e.py (random adapters
are not better than the base model): this is about the machinery.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import lifecycle
from flywheel.adapters.local import AdapterStore
from flywheel.config import DbSettings, Settings
from flywheel.db.outbox import append_events
from flywheel.events import AdapterTrained, AdapterTrainedPayload
from flywheel.gate.candidate import GateService
from flywheel.mining.store import freeze_eval_set, store_task
from flywheel.policy.factory import make_policy
from flywheel.serving.completions import complete
from flywheel.serving.request import parse_request
from flywheel.serving.sync import ServingSync
from tests.support.helpers import machinery_gate
from tests.support.vllm_server import Proxy, RealVLLM, served_settings, unload
from tests.test_policy_vllm_server import weather_task

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.postgres]
POLICY = "gated"  # its own policy name: the session's server keeps other tests' adapters


def gate_settings(home: Path, db_url: str, urls: list[str]) -> Settings:
    s = served_settings(home, urls, max_tokens=24, envs=["tool_call"])
    return s.model_copy(update={
        "policy": POLICY, "db": DbSettings(url=db_url),
        "gate": machinery_gate(s.gate, mode="auto", samples_per_task=2),
        "trainer": s.trainer.model_copy(update={"adapters_dir": home / "adapters"})})


async def register(engine: AsyncEngine, settings: Settings, version: int, source: Path) -> None:
    """What the trainer does: publish atomically, register, emit AdapterTrained."""
    assert settings.trainer.adapters_dir is not None
    ref = AdapterStore(settings.trainer.adapters_dir).publish(
        POLICY, version, source, base_model="smollm2", steps=version,
        parent_version=version - 1 or None)
    event = AdapterTrained(aggregate_id=ref.name, payload=AdapterTrainedPayload(
        policy=POLICY, version=version, parent_version=version - 1 or None, path=str(ref.path),
        stage="grpo", steps=version, groups=0, stale_dropped=0, metrics={}))
    async with engine.begin() as conn:
        await lifecycle.project(conn, event)
        await append_events(conn, [event], settings.topics)


def listed(url: str) -> dict[str, str]:
    data = httpx.get(f"{url}/v1/models", timeout=30).raise_for_status().json()
    return {card["id"]: card["root"] for card in data["data"]}


async def chat(serving: ServingSync, body: dict[str, Any]) -> dict[str, Any]:
    """`POST /v1/chat/completions` without the HTTP layer."""
    return await complete(serving, parse_request(json.dumps(body).encode()))


async def test_the_gate_promotes_through_vllm_and_serving_follows_on_every_replica(
        vllm_server: RealVLLM, vllm_adapters: dict[str, Path], db_url: str,
        engine: AsyncEngine, tmp_path: Path) -> None:
    proxy = Proxy(vllm_server.cfg.port)
    urls = [vllm_server.url, proxy.url]
    settings = gate_settings(tmp_path, db_url, urls)
    for version, name in ((1, "v1"), (2, "v2")):
        await register(engine, settings, version, vllm_adapters[name])
    async with engine.begin() as conn:
        for city in ("Oslo", "Lima"):
            await store_task(conn, weather_task(city), uuid.uuid4(), "human_correction",
                             settings.topics)
        await freeze_eval_set(conn, settings.topics)
    policy = make_policy(settings)
    serving = ServingSync(settings, engine, policy)
    request = {"model": "production", "max_tokens": 8,
               "messages": [{"role": "user", "content": "Say hi"}]}
    try:
        # (e) the gate: candidate v1 against the base model, both sampled by vLLM.
        events = await GateService(settings, engine, policy).evaluate_version(1)
        failed = [c for c in getattr(events[0].payload, "checks", []) if not c.passed]
        assert [e.type for e in events] == ["AdapterEvaluated", "AdapterPromoted"], failed
        async with engine.connect() as conn:
            record = (await conn.execute(text(
                "SELECT record FROM evaluations WHERE version = 1"))).scalar_one()
            runs = (await conn.execute(text("SELECT count(*) FROM eval_runs"))).scalar_one()
        assert record["candidate"]["samples"] + record["candidate"]["not_run"] == 4
        assert record["candidate"]["not_run"] == 0 and record["baseline_version"] is None
        assert runs == 2  # candidate and base model, both cached

        # (d) serving: production → v1 on every replica, then v2, then a rollback to v1.
        assert await serving.sync_once()
        for url in urls:
            assert f"{POLICY}@v1" in listed(url)
        assert (await chat(serving, request))["model"] == f"{POLICY}@v1"
        (promoted,) = [e for e in await GateService(settings, engine, policy)
                       .evaluate_version(2) if e.type == "AdapterPromoted"]
        assert await serving.sync_once()
        for url in urls:
            assert listed(url)[f"{POLICY}@v2"].endswith(f"{POLICY}/v2")
        answer = await chat(serving, request)
        assert answer["model"] == f"{POLICY}@v2" and answer["usage"]["completion_tokens"] > 0
        async with engine.begin() as conn:
            back = await lifecycle.rollback(conn, POLICY, to=None, actor="bob",
                                            reason="regressed", topics=settings.topics)
        assert back.payload.to_version == 1
        assert await serving.sync_once()
        assert (await chat(serving, request))["model"] == f"{POLICY}@v1"
        async with engine.connect() as conn:
            state = (await conn.execute(text(
                "SELECT version, replicas FROM serving_state WHERE policy = :p"),
                {"p": POLICY})).one()
            switched = (await conn.execute(text("""SELECT payload FROM events
                WHERE type = 'ServingSwitched' ORDER BY seq"""))).scalars().all()
        assert tuple(state) == (1, urls)
        assert [(p["version"], p["replicas"]) for p in switched] == [
            (1, urls), (2, urls), (1, urls)]
        assert switched[1]["cause_event_id"] == str(promoted.event_id)
    finally:
        await serving.close()
        proxy.kill()
        unload(vllm_server.url, f"{POLICY}@v1", f"{POLICY}@v2")
