"""A tool call read by vLLM's `hermes` parser equals what the policy's chat format reads from
the very same generated text (the `vllm` tests).

vLLM runs with `--enable-auto-tool-choice --tool-call-parser hermes` and the policy's chat
template (`flywheel.policy.vllm_flags.chat_template_for`): an agent served by vLLM directly
must get the calls the gate and the verifier read. Needs the tool-call protocol's
`flywheel.policy.chat_format` (branch `protocol`); skipped until it is merged.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from flywheel.policy.model_cache import resolve_model_dir
from tests.support.vllm_server import REPORT, SERVED, RealVLLM, post

chat_format = pytest.importorskip(
    "flywheel.policy.chat_format",
    reason="needs flywheel.policy.chat_format (the tool-call protocol, branch `protocol`)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def few_shot(city: str) -> list[dict[str, Any]]:
    """Three answered requests, then a fourth: the untuned 135M model copies the format."""
    messages: list[dict[str, Any]] = []
    for i, seen in enumerate(("Rome", "Lima", "Oslo")):
        messages += [
            {"role": "user", "content": f"What is the weather in {seen}?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{i}", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": seen})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": '{"temp_c": 20}'},
            {"role": "assistant", "content": f"It is 20 °C in {seen}."}]
    return [*messages, {"role": "user", "content": f"What is the weather in {city}?"}]


def calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []]


async def test_vllm_hermes_parser_reads_the_calls_our_chat_format_reads(
        vllm_server: RealVLLM) -> None:
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(None)
    fmt = chat_format.load_chat_format(model_dir)
    assert vllm_server.cfg.chat_template == fmt.path, "vLLM must serve the policy's template"
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    resp = post(vllm_server.url, "/v1/chat/completions", {
        "model": SERVED, "messages": few_shot("Paris"), "tools": [WEATHER],
        "tool_choice": "auto", "n": 8, "temperature": 0.7, "seed": 3, "max_tokens": 48,
        "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    with_calls = 0
    for choice in choices:
        text = tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
        ours = fmt.parse(text)
        assert calls(choice["message"]) == calls(ours), (text, choice["message"], ours)
        with_calls += bool(choice["message"].get("tool_calls"))
    REPORT["tool calls: hermes == chat_format.parse"] = f"{len(choices)}/{len(choices)} " \
        f"replies agree, {with_calls} with a call"
    assert with_calls > 0, "no reply called the tool: the comparison would be empty"
