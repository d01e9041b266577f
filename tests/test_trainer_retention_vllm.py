"""The trainer's retention never deletes an adapter directory a vLLM replica still lists:
vLLM reads it again after an eviction from `--max-cpu-loras`, and a missing directory then
kills the replica's engine (infra/vllm.md). Real store and Postgres, the replicas' listing
through the real client against a fake vLLM (httpx.MockTransport)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters.local import AdapterStore
from flywheel.config import RolloutSettings, Settings, TrainerSettings
from flywheel.policy import vllm
from flywheel.trainer.learner import TrainerService

pytestmark = [pytest.mark.postgres]


def _publish(store: AdapterStore, tmp: Path, versions: range) -> None:
    for v in versions:
        src = tmp / f"src{v}"
        src.mkdir()
        (src / "adapter_config.json").write_text("{}")
        (src / "adapter_model.safetensors").write_bytes(b"w" * v)
        store.publish("policy", v, src, base_model="m", steps=v)


def _trainer(engine: AsyncEngine, store: AdapterStore, rollout: RolloutSettings) -> Any:
    fake = SimpleNamespace(engine=engine, store=store, policy="policy",
                           settings=Settings(rollout=rollout,
                                             trainer=TrainerSettings(keep_versions=1)))
    return fake


def _listing(names: list[str], down: bool = False) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        if down:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"object": "list", "data": [
            {"id": n, "root": f"/adapters/{n}"} for n in ["base", *names]]})
    return httpx.MockTransport(handle)


async def test_versions_a_replica_lists_are_kept(engine: AsyncEngine, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store = AdapterStore(tmp_path / "adapters")
    _publish(store, tmp_path, range(1, 6))
    transports = iter([_listing(["policy@v2", "other@v1"]), _listing(["policy@v3"])])
    real = vllm.served_versions

    async def served(urls: list[str], policy: str) -> set[int]:
        found = set()
        for url in urls:  # each replica through the real client
            found |= await real([url], policy, transport=next(transports))
        return found

    monkeypatch.setattr(vllm, "served_versions", served)
    rollout = RolloutSettings(engine="vllm", vllm_urls=["http://a:8000", "http://b:8000"])
    await TrainerService._retain(_trainer(engine, store, rollout))
    assert store.versions("policy") == [2, 3, 5]  # listed somewhere, or the newest


async def test_nothing_is_deleted_while_a_replica_cannot_be_asked(
        engine: AsyncEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = AdapterStore(tmp_path / "adapters")
    _publish(store, tmp_path, range(1, 4))
    real = vllm.served_versions

    async def served(urls: list[str], policy: str) -> set[int]:
        return await real(urls, policy, transport=_listing([], down=True))

    monkeypatch.setattr(vllm, "served_versions", served)
    rollout = RolloutSettings(engine="vllm", vllm_urls=["http://a:8000"])
    await TrainerService._retain(_trainer(engine, store, rollout))
    assert store.versions("policy") == [1, 2, 3]
    await TrainerService._retain(_trainer(engine, store, RolloutSettings()))  # local engine
    assert store.versions("policy") == [3]
    assert json.loads((store.path("policy", 3) / "manifest.json").read_text())["version"] == 3
