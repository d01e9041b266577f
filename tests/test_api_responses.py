"""The Responses request, the chat completion it is answered as, and the `response` object
and event stream, without a model: the shapes are checked by the official `openai`
client's own types and its stream accumulator."""

from __future__ import annotations

import json
from typing import Any

import pytest

from flywheel.serving.request import RequestError
from flywheel.serving.responses_body import assistant_message, response_body, stream_events
from flywheel.serving.responses_request import parse_responses_request, to_chat_request

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def request(**fields: Any) -> bytes:
    return json.dumps({"model": "production", "input": "Weather in Oslo?", **fields}).encode()


def refused(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as caught:
        to_chat_request(parse_responses_request(raw), [])
    return caught.value


def completion(content: str | None, calls: list[tuple[str, str]], finish: str
               ) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = [{"id": f"call_x_{k}", "type": "function",
                                  "function": {"name": n, "arguments": a}}
                                 for k, (n, a) in enumerate(calls)]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1764620000,
            "model": "policy@v3", "choices": [{"index": 0, "message": message,
                                               "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 17, "total_tokens": 137}}


def test_input_items_become_the_chat_the_chat_format_renders() -> None:
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    raw = request(instructions="Be brief.", tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=30, temperature=0, seed=4,
                  input=[{"role": "user", "content": [{"type": "input_text", "text": "Oslo"},
                                                      {"type": "input_text", "text": "Lima"}]},
                         {"type": "message", "role": "assistant", "content": [
                             {"type": "output_text", "text": "Checking both."}]},
                         {"type": "function_call", "call_id": "c1", "name": "get_weather",
                          "arguments": '{"city": "Oslo"}'},
                         {"type": "function_call", "call_id": "c2", "name": "get_weather",
                          "arguments": '{"city": "Lima"}'},
                         {"type": "function_call_output", "call_id": "c1", "output": "5 C"},
                         {"type": "function_call_output", "call_id": "c2", "output": [
                             {"type": "input_text", "text": "20 C"}]}])
    chat, conversation = to_chat_request(parse_responses_request(raw), history)
    calls = [{"id": c, "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city})}}
        for c, city in (("c1", "Oslo"), ("c2", "Lima"))]
    assert chat.template_messages() == [
        {"role": "system", "content": "Be brief."}, *history,
        {"role": "user", "content": "Oslo\nLima"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "20 C"}]
    assert conversation == chat.template_messages()[1:]  # instructions are not inherited
    assert chat.template_tools() == [{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}]
    assert (chat.choice(), chat.parallel_tool_calls, chat.max_tokens, chat.temperature,
            chat.seed) == ("required", False, 30, 0, 4)


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"input": 5}, "input", "invalid_type"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0]", "invalid_value"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output",
     "missing_required_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type", "invalid_value"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "invalid_value"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name", "invalid_value"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format",
     "unsupported_parameter"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
])
def test_malformed_fields_name_the_parameter(fields: dict[str, Any], param: str,
                                             code: str) -> None:
    err = refused(request(**fields))
    assert (err.status, err.param, err.code) == (400, param, code), err.message
    assert param.split("[")[0].split(".")[0] in err.message, err.message


def test_bodies_that_are_not_requests() -> None:
    assert refused(b"").code == "invalid_json"
    assert refused(b"[1]").message == "the request body must be a JSON object (a responses " \
                                      "request)"
    missing = refused(json.dumps({"model": "production"}).encode())
    assert (missing.param, missing.code) == ("input", "missing_required_parameter")


def _parsed(body: dict[str, Any]) -> Any:
    return openai.types.responses.Response.model_validate(body)


def test_a_reply_with_text_and_two_calls_as_the_openai_client_reads_it() -> None:
    call = parse_responses_request(request(tools=[WEATHER], metadata={"k": "v"}))
    body = response_body(call, completion("Checking.", [
        ("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Lima"}')],
        "tool_calls"), "resp_abc")
    parsed = _parsed(body)
    assert parsed.output_text == "Checking." and parsed.status == "completed"
    assert [(o.type, getattr(o, "call_id", None)) for o in parsed.output] == [
        ("message", None), ("function_call", "call_x_0"), ("function_call", "call_x_1")]
    assert parsed.usage is not None and (parsed.usage.input_tokens,
                                         parsed.usage.output_tokens) == (120, 17)
    assert parsed.model == "policy@v3" and parsed.tool_choice == "auto"
    assert parsed.metadata == {"k": "v"} and parsed.tools[0].name == "get_weather"
    assert assistant_message(body) == {"role": "assistant", "content": "Checking.",
                                       "tool_calls": [
        {"id": "call_x_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_x_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]}


def test_a_cut_reply_is_incomplete() -> None:
    body = response_body(parse_responses_request(request(max_output_tokens=3)),
                         completion("It is", [], "length"), "resp_cut")
    parsed = _parsed(body)
    assert parsed.status == "incomplete" and parsed.incomplete_details is not None
    assert parsed.incomplete_details.reason == "max_output_tokens"
    assert [e["type"] for e in stream_events(body)][-1] == "response.incomplete"


@pytest.mark.parametrize("content", ["The weather in Oslo is  mild today.", None])
def test_the_stream_assembles_exactly_the_response(content: str | None) -> None:
    from openai.lib.streaming.responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    call = parse_responses_request(request(tools=[WEATHER]))
    calls = [("get_weather", '{"city": "Oslo", "unit": "celsius"}')] if content is None else []
    body = response_body(call, completion(content, calls, "tool_calls" if calls else "stop"),
                         "resp_s")
    events = list(stream_events(body))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=[WEATHER], text_format=openai.omit)
    deltas = []
    for raw in events:
        event = openai._models.construct_type_unchecked(type_=ResponseStreamEvent, value=raw)
        for out in state.handle_event(event):
            if out.type in ("response.output_text.delta",
                            "response.function_call_arguments.delta"):
                deltas.append(out.delta)
    final = events[-1]["response"]
    assert final == body
    snapshot = state.handle_event(openai._models.construct_type_unchecked(
        type_=ResponseStreamEvent, value=events[-1]))[0].response
    assert snapshot.model_dump(exclude_none=True)["output"] == \
        _parsed(body).model_dump(exclude_none=True)["output"]
    assert "".join(deltas) == (content or calls[0][1])
    assert len(deltas) > 3  # cut into pieces, not one blob
