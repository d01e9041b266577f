"""Serving through the vLLM engine (`rollout.engine = vllm`): `POST /v1/chat/completions` goes
through `VLLMPolicy.sample(..., tools=...)` and Flywheel's own parse, so it answers exactly
as on the local engine.

The replica is the fake vLLM of tests/test_policy_vllm.py, rendering with the policy's real
chat format as a vLLM started with `--chat-template` does (a final assistant message under
`continue_final_message` is continued, not closed). `VLLMPolicy` checks the ids it renders
against the replica's, so a prefill that rendered differently on the two sides would fail.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from flywheel.config import RolloutSettings, Settings
from flywheel.db.engine import make_engine
from flywheel.policy.chat_format import ChatFormat, load_chat_format
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.policy.tool_choice import decoding
from flywheel.serving.completions import complete
from flywheel.serving.request import parse_request
from flywheel.serving.sync import ServingSync
from tests.test_policy_vllm import FakeCluster

pytest.importorskip("transformers")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
OSLO = [{"role": "user", "content": "What's the weather in Oslo?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return load_chat_format(resolve_model_dir(None))


@pytest.fixture
async def cluster_and_serving(fmt: ChatFormat, tmp_path: Any
                              ) -> AsyncIterator[tuple[FakeCluster, ServingSync]]:
    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        if messages and messages[-1]["role"] == "assistant":  # continue_final_message
            return fmt.encode(fmt.render_text(messages[:-1], tools) + messages[-1]["content"])
        return fmt.render(messages, tools)

    cluster = FakeCluster(1)
    cluster.replicas[0].render = render
    settings = Settings(home=tmp_path, rollout=RolloutSettings(
        engine="vllm", vllm_urls=[cluster.replicas[0].url], vllm_model="base"))
    # `base` is addressed directly: no production pointer is read, so no database is used.
    engine = make_engine("postgresql+asyncpg://nobody@127.0.0.1:9/unused")
    serving = ServingSync(settings, engine, cluster.policy(chat_format=fmt))
    yield cluster, serving
    await serving.close()
    await engine.dispose()


def request(**fields: Any) -> Any:
    return parse_request(json.dumps({"model": "base", "messages": OSLO, "tools": [WEATHER],
                                     "temperature": 0, **fields}).encode())


def sent(cluster: FakeCluster) -> dict[str, Any]:
    return [b for p, b in cluster.replicas[0].bodies if p == "/v1/chat/completions"][-1]


async def test_auto_sends_the_tools_and_parses_the_raw_reply(
        cluster_and_serving: tuple[FakeCluster, ServingSync]) -> None:
    cluster, serving = cluster_and_serving
    cluster.replicas[0].texts = [CALL]
    answer = await complete(serving, request(return_token_ids=True))
    body = sent(cluster)
    assert body["tools"] == [WEATHER] and body["tool_choice"] == "none"
    assert "continue_final_message" not in body and "stop" not in body
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls" and answer["model"] == "base"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]] == [("get_weather", {"city": "Oslo"})]
    assert answer["prompt_token_ids"] == serving.policy().chat_format.render(OSLO, [WEATHER])


async def test_required_prefills_through_vllm_and_parses_with_the_prefill(
        cluster_and_serving: tuple[FakeCluster, ServingSync], fmt: ChatFormat) -> None:
    cluster, serving = cluster_and_serving
    prefill = '<tool_call>\n{"name": "'
    cluster.replicas[0].texts = [CALL.removeprefix(prefill) + "\nmore text"]
    answer = await complete(serving, request(tool_choice="required", parallel_tool_calls=False))
    body = sent(cluster)
    assert body["messages"][-1] == {"role": "assistant", "content": prefill}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    # vLLM decodes the rest under the call grammar (its `guidance` backend), not a stop string
    want = decoding(fmt, OSLO, [WEATHER], "required", parallel=False)
    assert body["structured_outputs"] == {"grammar": want.grammar} and "stop" not in body
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    # the prompt ids include the prefill, rendered as the local engine renders it
    assert answer["usage"]["prompt_tokens"] == len(fmt.encode(
        fmt.render_text(OSLO, [WEATHER]) + prefill))


async def test_none_returns_the_text_as_vllm_does(
        cluster_and_serving: tuple[FakeCluster, ServingSync]) -> None:
    cluster, serving = cluster_and_serving
    cluster.replicas[0].texts = [CALL]
    answer = await complete(serving, request(tool_choice="none"))
    assert sent(cluster)["tools"] == [WEATHER]  # still rendered
    (choice,) = answer["choices"]
    assert choice["message"]["content"] == CALL and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
