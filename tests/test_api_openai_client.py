"""The production endpoint through the official `openai` client, with the real SmolLM2-135M
behind a live API (real HTTP, real SSE) and the real operator lifespan.

The untuned model never calls a tool on its own, so the conditions that make its behaviour
deterministic and meaningful are the ones serving adds: greedy decoding (`temperature: 0`)
with `tool_choice` "required" or a named function (the call opening is prefilled and parsed
with the prefill in front) and `parallel_tool_calls: false` (stop after the first call).
Two parallel calls come from a conversation whose history shows the model a two-call turn.
Production is the base model here (no version promoted); `policy@v1` is a published fresh
LoRA (served, listed), `policy@v2` is registered without an artifact (not listed).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from flywheel.config import ApiSettings, DbSettings, RolloutSettings, Settings, TrainerSettings
from flywheel.db.engine import make_engine
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.stack.postgres import LocalPostgres
from tests.support.serving_helpers import live_api, register_version

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TOKEN, OPERATE = "tok-publish", "tok-operate"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
EMAIL = {"type": "function", "function": {
    "name": "send_email", "description": "Send an email",
    "parameters": {"type": "object", "properties": {
        "to": {"type": "string", "examples": ["sam@example.com"]},
        "subject": {"type": "string", "examples": ["Hello"]}}, "required": ["to", "subject"]}}}
OSLO = [{"role": "user", "content": "What's the weather in Oslo?"}]
TWO_CITIES = [
    {"role": "user", "content": "What's the weather in Rome and in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": '{"temp_c": 20}'},
    {"role": "tool", "tool_call_id": "call_b", "content": '{"temp_c": 18}'},
    {"role": "assistant", "content": "Rome is 20 C and Paris is 18 C."},
    {"role": "user", "content": "What's the weather in Oslo and in Lima?"}]


@pytest.fixture(scope="module")
async def api_settings(postgres: LocalPostgres, template_db: str,
                       tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Settings]:
    """A database of its own for the module's one API, with v1 published and v2 registered."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = postgres.url.replace("postgresql+asyncpg://", "postgresql://")
    conn = await asyncpg.connect(admin.rsplit("/", 1)[0] + "/postgres")
    try:
        await conn.execute(f"CREATE DATABASE {name} TEMPLATE {template_db.rsplit('/', 1)[1]}")
    finally:
        await conn.close()
    home = tmp_path_factory.mktemp("serving")
    settings = Settings(
        home=home, db=DbSettings(url=postgres.url.rsplit("/", 1)[0] + f"/{name}"),
        api=ApiSettings(tokens={TOKEN: ["publish"], OPERATE: ["operate"]}, serve=True),
        rollout=RolloutSettings(model_dir=resolve_model_dir(None)),
        trainer=TrainerSettings(adapters_dir=home / "adapters"))
    engine = make_engine(settings.db.url or "")
    try:
        await register_version(settings, engine, 1, _fresh_lora(home / "lora"))
        await register_version(settings, engine, 2, None)
    finally:
        await engine.dispose()
    yield settings


def _fresh_lora(path: Path) -> Path:
    """A LoRA adapter as the trainer saves it, untrained (it answers like the base model)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
                   ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base_url(api_settings: Settings) -> Iterator[str]:
    with live_api(api_settings) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=TOKEN, max_retries=0,
                       timeout=600) as c:
        yield c


def greedy(client: Any, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model="production", messages=messages,
                                          temperature=0, seed=7, **kwargs)


def calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls or []]


@pytest.fixture(scope="module")
def two_calls(client: Any) -> Any:
    """The non-streamed answer the streaming test must reproduce."""
    return greedy(client, TWO_CITIES, tools=[WEATHER], tool_choice="required", max_tokens=64)


def test_one_call(client: Any) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="production", messages=OSLO, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=24)
    answer = raw.parse()
    assert raw.headers["x-flywheel-model"] == "base" == answer.model
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls(choice.message) == [("get_weather", {"city": "Oslo"})]
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert answer.usage.prompt_tokens > 150 and 0 < answer.usage.completion_tokens <= 24


def test_two_parallel_calls(two_calls: Any) -> None:
    (choice,) = two_calls.choices
    got = calls(choice.message)
    assert choice.finish_reason == "tool_calls" and len(got) == 2, choice.message
    assert {name for name, _ in got} == {"get_weather"}
    assert all(isinstance(args.get("city"), str) for _, args in got)
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == 2 and not set(ids) & {"call_a", "call_b"}  # unique in the chat


def test_tool_choice_none_gives_text_from_the_same_prompt(client: Any) -> None:
    auto = greedy(client, OSLO, tools=[WEATHER], max_tokens=8)
    none = greedy(client, OSLO, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert none.choices[0].message.tool_calls is None
    assert isinstance(none.choices[0].message.content, str) and none.choices[0].message.content
    # the tools stay in the prompt (vLLM's behaviour): same prompt, same greedy text
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens
    bare = greedy(client, OSLO, max_tokens=1)
    assert bare.usage.prompt_tokens < none.usage.prompt_tokens
    assert none.choices[0].message.content == auto.choices[0].message.content


def test_named_function(client: Any) -> None:
    answer = greedy(client, [{"role": "user", "content": "Tell tom@example.com the "
                              "release moved to Friday."}], tools=[WEATHER, EMAIL],
                    tool_choice={"type": "function", "function": {"name": "send_email"}},
                    max_tokens=32)
    (choice,) = answer.choices
    ((name, args),) = calls(choice.message)
    assert name == "send_email" and choice.finish_reason == "tool_calls"
    assert isinstance(args, dict) and args, choice.message


def test_streaming_assembles_exactly_the_non_streamed_calls(client: Any,
                                                            two_calls: Any) -> None:
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    kinds = []
    with greedy(client, TWO_CITIES, tools=[WEATHER], tool_choice="required", max_tokens=64,
                stream=True, stream_options={"include_usage": True}) as stream:
        for chunk in stream:
            kinds.append("usage" if not chunk.choices else "choice")
            state.handle_chunk(chunk)
    final = state.get_final_completion()
    (choice,) = final.choices
    (want,) = two_calls.choices
    assert [(c.id, c.type, c.function.name, c.function.arguments)
            for c in choice.message.tool_calls] == \
        [(c.id, c.type, c.function.name, c.function.arguments) for c in want.message.tool_calls]
    assert choice.finish_reason == want.finish_reason == "tool_calls"
    assert final.usage is not None and final.usage.completion_tokens == \
        two_calls.usage.completion_tokens
    assert kinds[-1] == "usage" and kinds.count("usage") == 1 and final.model == "base"


def test_malformed_requests_get_openai_errors(client: Any, base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="production", messages=OSLO, max_tokens="abc")
    assert (bad.value.status_code, bad.value.param, bad.value.code) == \
        (400, "max_tokens", "invalid_type")
    assert "max_tokens" in bad.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="policy@v99", messages=OSLO)
    assert missing.value.code == "model_not_found" and "policy@v99" in missing.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0
                      ).models.list()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    for raw in (b"", b"{oops", b'{"model": "production", "messages": '
                + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        r = httpx.post(f"{base_url}/v1/chat/completions", content=raw, headers=headers)
        assert r.status_code == 400, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    forbidden = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "base",
                           "messages": OSLO}, headers={"Authorization": f"Bearer {OPERATE}"})
    assert forbidden.status_code == 403 and "publish" in forbidden.json()["error"]["message"]


def test_models_and_a_version_addressed_by_name(client: Any) -> None:
    listed = client.models.list()
    assert [m.id for m in listed.data] == ["production", "base", "policy@v1"]
    production = client.models.retrieve("production")
    assert production.model_extra["alias_of"] == "base"
    answer = client.chat.completions.create(model="policy@v1", messages=OSLO, max_tokens=2,
                                            temperature=0)
    assert answer.model == "policy@v1"


@pytest.mark.parametrize("model", [
    "policy@v2147483648", "policy@v9223372036854775808", "policy@v²", "policy@v" + "9" * 5000,
    "policy@v٣", "policy@v０", "policy@v0", "policy@v-1", "policy@v"])
def test_a_version_that_cannot_exist_is_an_unknown_model(client: Any, model: str) -> None:
    """Out of the `integer` range, Unicode digits, past Python's int-parsing limit: 404 in
    OpenAI's shape, never a 500 and never another version (`٣` is not v3)."""
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model=model, messages=OSLO, max_tokens=1)
    assert missing.value.code == "model_not_found"


def test_errors_before_and_around_the_routes_have_the_openai_shape(base_url: str) -> None:
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
                     f"{TOKEN}\r\nContent-Type: application/json\r\nContent-Length: "
                     f"{10**12}\r\n\r\n{{}}".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply
    assert json.loads(body)["error"]["code"] == "request_too_large"
    wrong_method = httpx.get(f"{base_url}/v1/chat/completions",
                             headers={"Authorization": f"Bearer {TOKEN}"})
    assert wrong_method.status_code == 405 and set(wrong_method.json()) == {"error"}
