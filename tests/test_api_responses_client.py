"""`POST /v1/responses` through the official `openai` client (`client.responses.create`,
`client.responses.stream`), with the real SmolLM2-135M behind a live API (real HTTP, real
SSE) and the real operator lifespan; production is the base model.

As in the chat test (tests/test_api_openai_client.py), what makes the untuned model's
behaviour deterministic is greedy decoding with `tool_choice` "required" (the call opening
prefilled) and `parallel_tool_calls: false`. A Responses call is answered as the chat
completion it is: the same conversation through `/v1/chat/completions` gives the same calls
and the same prompt token count, which is what "decoded as the gate decodes" rests on.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

from flywheel.config import ApiSettings, DbSettings, RolloutSettings, Settings
from flywheel.db.engine import make_engine
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.serving.responses_store import load, save
from flywheel.stack.postgres import LocalPostgres
from tests.support.serving_helpers import live_api

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TOKEN = "tok-publish"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                 if k != "type"}}
OSLO = "What's the weather in Oslo?"
TWO_CITIES: list[dict[str, Any]] = [  # a conversation showing the model a two-call turn
    {"role": "user", "content": "What's the weather in Rome and in Paris?"},
    {"type": "function_call", "call_id": "call_a", "name": "get_weather",
     "arguments": '{"city": "Rome"}'},
    {"type": "function_call", "call_id": "call_b", "name": "get_weather",
     "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_a", "output": '{"temp_c": 20}'},
    {"type": "function_call_output", "call_id": "call_b", "output": '{"temp_c": 18}'},
    {"role": "assistant", "content": "Rome is 20 C and Paris is 18 C."},
    {"role": "user", "content": "What's the weather in Oslo and in Lima?"}]
TWO_CITIES_CHAT = [
    TWO_CITIES[0],
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": i["call_id"], "type": "function",
         "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in TWO_CITIES[1:3]]},
    *({"role": "tool", "tool_call_id": i["call_id"], "content": i["output"]}
      for i in TWO_CITIES[3:5]),
    *TWO_CITIES[5:]]


@pytest.fixture(scope="module")
async def api_settings(postgres: LocalPostgres, template_db: str,
                       tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Settings]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = postgres.url.replace("postgresql+asyncpg://", "postgresql://")
    conn = await asyncpg.connect(admin.rsplit("/", 1)[0] + "/postgres")
    try:
        await conn.execute(f"CREATE DATABASE {name} TEMPLATE {template_db.rsplit('/', 1)[1]}")
    finally:
        await conn.close()
    home = tmp_path_factory.mktemp("responses")
    yield Settings(home=home, db=DbSettings(url=postgres.url.rsplit("/", 1)[0] + f"/{name}"),
                   api=ApiSettings(tokens={TOKEN: ["publish"]}, serve=True),
                   rollout=RolloutSettings(model_dir=resolve_model_dir(None)))


@pytest.fixture(scope="module")
def client(api_settings: Settings) -> Iterator[Any]:
    with live_api(api_settings) as url, openai.OpenAI(
            base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=600) as c:
        yield c


def greedy(client: Any, **kwargs: Any) -> Any:
    return client.responses.create(model="production", temperature=0,
                                   extra_body={"seed": 7}, **kwargs)


def calls(response: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(o.name, json.loads(o.arguments)) for o in response.output
            if o.type == "function_call"]


def without_ids(response: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in o.model_dump(exclude_none=True).items() if k != "id"}
            for o in response.output]


@pytest.fixture(scope="module")
def two_calls(client: Any) -> Any:
    """The non-streamed answer the streaming test must reproduce."""
    return greedy(client, input=TWO_CITIES, tools=[WEATHER], tool_choice="required",
                  max_output_tokens=64)


def test_one_call(client: Any) -> None:
    raw = client.responses.with_raw_response.create(
        model="production", input=OSLO, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_output_tokens=24)
    response = raw.parse()
    assert raw.headers["x-flywheel-model"] == "base" == response.model
    assert response.status == "completed" and response.object == "response"
    assert calls(response) == [("get_weather", {"city": "Oslo"})]
    (item,) = response.output
    assert item.type == "function_call" and item.call_id.startswith("call_")
    assert item.id.startswith("fc_") and response.id.startswith("resp_")
    assert response.usage.input_tokens > 150 and 0 < response.usage.output_tokens <= 24
    assert response.tool_choice == "required" and response.tools[0].name == "get_weather"


def test_two_parallel_calls_are_the_chat_endpoint_calls(client: Any, two_calls: Any) -> None:
    got = calls(two_calls)
    assert len(got) == 2 and {name for name, _ in got} == {"get_weather"}, two_calls.output
    assert all(isinstance(args.get("city"), str) for _, args in got)
    ids = [o.call_id for o in two_calls.output if o.type == "function_call"]
    assert len(set(ids)) == 2 and not set(ids) & {"call_a", "call_b"}
    chat = client.chat.completions.create(
        model="production", messages=TWO_CITIES_CHAT, tools=[CHAT_WEATHER],
        tool_choice="required", temperature=0, seed=7, max_tokens=64)
    message = chat.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls] == got
    assert chat.usage.prompt_tokens == two_calls.usage.input_tokens


def test_tool_choice_none_gives_text_from_the_same_prompt(client: Any) -> None:
    auto = greedy(client, input=OSLO, tools=[WEATHER], max_output_tokens=8)
    none = greedy(client, input=OSLO, tools=[WEATHER], tool_choice="none",
                  max_output_tokens=8)
    assert calls(none) == [] and none.output_text
    assert [o.type for o in none.output] == ["message"]
    assert none.usage.input_tokens == auto.usage.input_tokens  # the tools stay rendered
    assert none.output_text == auto.output_text
    required = greedy(client, input=OSLO, tools=[WEATHER], tool_choice="required",
                      parallel_tool_calls=False, max_output_tokens=24)
    assert calls(required) == [("get_weather", {"city": "Oslo"})]


def test_a_previous_response_id_chain(client: Any) -> None:
    first = greedy(client, input=OSLO, instructions="Answer in one short sentence.",
                   tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                   max_output_tokens=24)
    (call,) = [o for o in first.output if o.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": '{"temp_c": 5, "sky": "clear"}'}
    second = greedy(client, previous_response_id=first.id, input=[result], tools=[WEATHER],
                    tool_choice="none", max_output_tokens=12)
    assert second.previous_response_id == first.id and second.output_text
    # The same conversation sent whole (the first call's instructions are not inherited).
    whole = greedy(client, input=[{"role": "user", "content": OSLO},
                                  {"type": "function_call", "call_id": call.call_id,
                                   "name": call.name, "arguments": call.arguments}, result],
                   tools=[WEATHER], tool_choice="none", max_output_tokens=12, store=False)
    assert whole.output_text == second.output_text
    assert whole.usage.input_tokens == second.usage.input_tokens
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    with pytest.raises(openai.BadRequestError) as gone:
        greedy(client, previous_response_id=whole.id, input="and tomorrow?")
    assert (gone.value.code, gone.value.param) == ("previous_response_not_found",
                                                   "previous_response_id")


def test_streaming_assembles_exactly_the_non_streamed_output(client: Any,
                                                             two_calls: Any) -> None:
    kinds = []
    with client.responses.stream(model="production", temperature=0, extra_body={"seed": 7},
                                 input=TWO_CITIES, tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=64) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert without_ids(final) == without_ids(two_calls)
    assert final.usage.output_tokens == two_calls.usage.output_tokens
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-1] == "response.completed" and \
        kinds.count("response.function_call_arguments.done") == 2
    # The raw events too, assembled by hand from the deltas.
    args: dict[int, str] = {}
    for event in greedy(client, input=TWO_CITIES, tools=[WEATHER], tool_choice="required",
                        max_output_tokens=64, stream=True):
        if event.type == "response.function_call_arguments.delta":
            args[event.output_index] = args.get(event.output_index, "") + event.delta
    assert list(args.values()) == [o.arguments for o in two_calls.output
                                   if o.type == "function_call"]


def test_malformed_requests_get_openai_errors(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="production", input=OSLO, max_output_tokens="abc")
    assert (bad.value.status_code, bad.value.param, bad.value.code) == \
        (400, "max_output_tokens", "invalid_type")
    with pytest.raises(openai.BadRequestError) as image:
        client.responses.create(model="production", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}])
    assert image.value.param == "input[0].content[0].type"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="gpt-9", input=OSLO)
    assert (unknown.value.code, unknown.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong").responses.create(model="production", input=OSLO)


async def test_the_store_keeps_only_the_newest(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        ids = [f"resp_{n:032x}" for n in range(5)]  # the shape the server hands out
        for n, rid in enumerate(ids):
            await save(engine, rid, [{"role": "user", "content": str(n)}], {"id": rid}, keep=2)
        kept = [n for n, rid in enumerate(ids) if await load(engine, rid) is not None]
        assert kept == [3, 4]
        assert await load(engine, ids[4]) == ([{"role": "user", "content": "4"}],
                                              {"id": ids[4]})
    finally:
        await engine.dispose()
