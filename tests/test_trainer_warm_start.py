"""The trainer's first stage follows the baseline: SFT version 1 when it says so, else none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import text

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.demo.simulate import simulate
from flywheel.events import GateMetrics
from flywheel.gate.baseline import store_baseline
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.trainer.learner import TrainerService
from tests.test_mining_demos_db import _ingest_and_mine

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _base(invalid: float, success: float) -> GateMetrics:
    return GateMetrics(version=None, tasks=20, samples=80, not_run=0, success_rate=success,
                       mean_reward=success, invalid_rate=invalid, unsafe_rate=0.0,
                       latency_mean_ms=1.0, latency_p95_ms=1.0, tokens_per_task=10.0,
                       groups={}, group_samples={})


def _settings(settings: Settings, tmp_path: Path) -> Settings:
    return settings.model_copy(update={
        "rollout": settings.rollout.model_copy(update={"model_dir": resolve_model_dir(None)}),
        "trainer": settings.trainer.model_copy(update={
            "adapters_dir": tmp_path / "adapters", "sft_steps": 2, "sft_epochs": 0.0,
            "sft_batch": 2, "lora_r": 4, "baseline_wait_s": 5.0})})


@pytest.mark.parametrize(("invalid", "success", "published"),
                         [(0.8, 0.05, True), (0.1, 0.4, False)])
async def test_first_stage_follows_the_baseline(settings: Settings, db_url: str, tmp_path: Path,
                                                invalid: float, success: float,
                                                published: bool) -> None:
    await _ingest_and_mine(db_url, list(simulate(300, agents=1, failure_rate=0.3, seed=7)))
    s = _settings(settings, tmp_path)
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        await store_baseline(conn, s.policy, 1, _base(invalid, success), None, s.gate)
    service = TrainerService(s, engine)
    await service.start()
    async with engine.connect() as conn:
        rows = (await conn.execute(text("""SELECT version, stage, parent_version, status,
            steps FROM adapter_versions"""))).all()
        events = (await conn.execute(text("""SELECT payload FROM events
            WHERE type = 'AdapterTrained'"""))).scalars().all()
    await engine.dispose()
    if not published:
        assert rows == [] and service.version is None
        return
    assert [tuple(r) for r in rows] == [(1, "sft", None, "candidate", 2)]
    assert service.version == 1 and service.trainer.steps == 2
    (event,) = events
    assert event["stage"] == "sft" and event["groups"] == 0
    manifest = json.loads((tmp_path / "adapters" / "policy" / "v1" / "manifest.json")
                          .read_text())
    assert manifest["stage"] == "sft" and manifest["extra"]["demonstrations"] > 0
    assert service.status.metrics["sft_loss"] > 0
