"""One rule for tool names: what serving accepts is what ingest (and so mining, training and
the gate, which read what ingest stored) accepts; and `/v1/models` names real parents."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import lifecycle
from flywheel.events import AdapterTrained, AdapterTrainedPayload
from flywheel.ingest.wire import validate_record
from flywheel.serving.completions import model_cards
from flywheel.serving.request import ChatRequest
from flywheel.trajectory import Trajectory

ACCEPTED = ["math.factorial", "civil_cases.retrieve", "github:create_issue", "get-order",
            "a" * 128, "mcp.server:tool_1"]
REFUSED = ["", "a" * 129, "get weather", "orders/refund", "naïve", "math.factorial\n"]


def _served(name: str) -> bool:
    try:
        ChatRequest.model_validate({"model": "production", "messages": [
            {"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
                "name": name, "parameters": {"type": "object", "properties": {}}}}]})
    except ValidationError:
        return False
    return True


def _ingested(name: str) -> bool:
    return isinstance(validate_record({"agent": "a", "messages": [
        {"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
            "name": name, "parameters": {"type": "object", "properties": {}}}}]}), Trajectory)


@pytest.mark.parametrize("name", ACCEPTED + REFUSED)
def test_serving_and_ingest_accept_the_same_names(name: str) -> None:
    assert _served(name) == _ingested(name) == (name in ACCEPTED)


@pytest.mark.postgres
async def test_models_name_each_versions_real_parent(engine: AsyncEngine) -> None:
    for version, parent, stage in ((1, None, "sft"), (2, 1, "grpo"), (3, 2, "grpo")):
        event = AdapterTrained(aggregate_id=f"policy@v{version}", payload=AdapterTrainedPayload(
            policy="policy", version=version, parent_version=parent, path="/x", stage=stage,
            steps=1, groups=0, stale_dropped=0, metrics={}))
        async with engine.begin() as conn:
            await lifecycle.project(conn, event)
    serving = SimpleNamespace(engine=engine, name="policy", current=None, adapters=SimpleNamespace(
        store=SimpleNamespace(versions=lambda policy: [1, 2, 3])))
    cards = await model_cards(serving)  # type: ignore[arg-type]
    assert {c["id"]: c.get("parent") for c in cards} == {
        "production": None, "base": None, "policy@v1": "base", "policy@v2": "policy@v1",
        "policy@v3": "policy@v2"}


