"""docs/FORMATS.md's Responses API examples run as written against a live API (the real
SmolLM2-135M as production): the OpenAI-client agent loop, whose logged chain then goes
through the decoding boundary as one trajectory, and the OpenAI Agents SDK agent."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flywheel.config import Settings
from flywheel.ingest.wire import validate_record
from flywheel.trajectory import Trajectory
from tests.support.serving_helpers import live_api
from tests.test_api_responses_client import TOKEN, api_settings  # noqa: F401

pytest.importorskip("openai")
pytest.importorskip("torch")
pytestmark = [pytest.mark.postgres, pytest.mark.slow]

FORMATS = Path(__file__).resolve().parents[1] / "docs" / "FORMATS.md"
_PYTHON = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def example(marker: str) -> str:
    """The python block of the Responses section that contains `marker`."""
    section = FORMATS.read_text().split("## Serving the Responses API", 1)[1]
    (block,) = [b for b in _PYTHON.findall(section) if marker in b]
    return block


@pytest.fixture(scope="module")
def base_url(api_settings: Settings) -> Iterator[str]:  # noqa: F811
    with live_api(api_settings) as url:
        yield url


def run(code: str, base_url: str, cwd: Path) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env={
                              **os.environ, "FLYWHEEL_URL": base_url, "FLYWHEEL_TOKEN": TOKEN})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_the_openai_client_agent_loop(base_url: str, tmp_path: Path) -> None:
    printed = run(example("client.responses.create"), base_url, tmp_path)
    assert printed and printed[-1].strip(), printed  # the final answer, in text
    (line,) = (tmp_path / "weather.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert len(record["responses"]) == 2
    t = validate_record(record)
    assert isinstance(t, Trajectory), t
    kinds = [(i.type, getattr(i, "role", None)) for i in t.items]
    assert kinds == [("message", "user"), ("function_call", None),
                     ("function_call_output", None), ("message", "assistant")]
    call = t.items[1].model_dump()
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Oslo"})
    assert json.loads(t.items[2].model_dump()["output"]) == {"city": "Oslo", "temp_c": 5}
    assert t.items[3].model_dump()["content"] == printed[-1]
    assert t.agent == "weather-bot" and t.model == "base" and t.status == "awaiting_outcome"
    assert t.metadata["response_ids"][0] == t.session_id == record["responses"][0]["id"]


def test_the_agents_sdk_agent(base_url: str, tmp_path: Path) -> None:
    pytest.importorskip("agents")
    printed = run(example("Runner.run_sync"), base_url, tmp_path)
    at = next(i for i, line in enumerate(printed) if line.startswith("['resp_"))
    items = [line.split(" ", 2) for line in printed[:at]]
    assert [kind for kind, *_ in items] == ["tool_call_item", "tool_call_output_item",
                                            "message_output_item"], printed
    assert items[0][1] == "get_weather" and json.loads(items[0][2]) == {"city": "Oslo"}
    ids = ast.literal_eval(printed[at])  # the example prints the list of response ids
    assert len(ids) == 2 and all(i.startswith("resp_") for i in ids)
    second = httpx.get(f"{base_url}/v1/responses/{ids[1]}",
                       headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert second["previous_response_id"] == ids[0]  # chained, not the history re-sent
    assert [i["type"] for i in second["output"]] == ["message"]
    assert "\n".join(printed[at + 1:]).strip(), printed  # the final output, in text
