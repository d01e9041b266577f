"""The OpenAI chat request, `tool_choice` decoding and the SSE chunks, without a model.

Request validation is pure; decoding and answers run on the real SmolLM2 tokenizer with the
bundled chat template (what serving, rollouts and the gate use) and scripted model texts.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from flywheel.policy.chat_format import ChatFormat, load_chat_format
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.policy.tool_choice import CallMarkup, answer, decoding, required_prefill
from flywheel.serving.request import RequestError, param_path, parse_request
from flywheel.serving.stream import chunks, events, pieces

pytest.importorskip("transformers")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
EMAIL = {"type": "function", "function": {
    "name": "send_email", "parameters": {"type": "object", "properties": {
        "to": {"type": "string"}, "subject": {"type": "string"}}, "required": ["to"]}}}
USER = [{"role": "user", "content": "Weather in Oslo?"}]


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "production", "messages": USER, **fields}).encode()


def refused(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse_request(raw)
    return caught.value


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return load_chat_format(resolve_model_dir(None))


# -- the request --------------------------------------------------------------------------------

def test_defaults_follow_openai() -> None:
    assert parse_request(body()).choice() == "none"
    request = parse_request(body(tools=[WEATHER], whatever={"unknown": "ignored"}))
    assert request.choice() == "auto" and request.parallel_tool_calls and request.n == 1
    named = parse_request(body(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    assert named.choice() == "function:get_weather"
    assert parse_request(body(stop="\n\n")).stops() == ("\n\n",)


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"max_tokens": "abc"}, "max_tokens", "invalid_type"),
    ({"max_tokens": "5"}, "max_tokens", "invalid_type"),  # strict, as OpenAI: no coercion
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"temperature": 3}, "temperature", "invalid_value"),
    ({"n": 0}, "n", "invalid_value"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]", "invalid_value"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name", "invalid_value"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
])
def test_malformed_fields_name_the_parameter(fields: dict[str, Any], param: str,
                                             code: str) -> None:
    err = refused(body(**fields))
    assert (err.status, err.param, err.code) == (400, param, code), err.message
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error",
                                    "param": param, "code": code}}
    assert param.split("[")[0].split(".")[0] in err.message


def test_missing_model_and_bodies_that_are_not_requests() -> None:
    err = refused(json.dumps({"messages": USER}).encode())
    assert (err.param, err.code) == ("model", "missing_required_parameter")
    for raw, says in [(b"", "empty"), (b"   ", "empty"), (b"{not json", "not valid JSON"),
                      (b"[1, 2]", "JSON object"), (b'"text"', "JSON object")]:
        err = refused(raw)
        assert err.status == 400 and says in err.message, (raw, err.message)


def test_parameters_that_would_change_the_answer_are_refused_not_ignored() -> None:
    assert parse_request(body(logprobs=False, frequency_penalty=0, response_format={
        "type": "text"}, logit_bias={}))
    for fields in ({"logprobs": True}, {"top_logprobs": 3}, {"presence_penalty": 0.5},
                   {"logit_bias": {"50256": -100}},
                   {"response_format": {"type": "json_object"}}):
        err = refused(body(**fields))
        (param,) = fields
        assert (err.param, err.code) == (param, "unsupported_parameter"), err.message


def test_deep_nesting_is_a_400_not_a_crash() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    for raw in (deep, b'{"model": "m", "messages": ' + deep + b"}",
                b'{"model": "m", "messages": [], "unknown": ' + deep + b"}"):
        err = refused(raw)
        assert err.code == "invalid_json" and "recursion" in err.message


def test_only_text_content_parts() -> None:
    err = refused(body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}]))
    assert err.param == "messages[0].content[1].type" and "text only" in err.message


def test_messages_in_the_shape_the_chat_format_renders() -> None:
    request = parse_request(body(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                     {"type": "text", "text": "in Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'},
        {"role": "function", "name": "get_weather", "content": "3 C"}], tools=[WEATHER]))
    assert request.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin Oslo?"},  # text parts joined as vLLM joins
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'},
        {"role": "tool", "name": "get_weather", "content": "3 C"}]
    assert request.template_tools() == [WEATHER]


def test_param_path_drops_union_labels() -> None:
    assert param_path(("messages", 0, "user", "content", "str")) == "messages[0].content"
    assert param_path(("messages", 2, "function", "name")) == "messages[2].name"
    assert param_path(("tools", 1, "function", "name")) == "tools[1].function.name"
    assert param_path(()) is None


# -- tool_choice decoding ---------------------------------------------------------------------

def test_call_markup_read_off_the_bundled_template(fmt: ChatFormat) -> None:
    tools = [WEATHER, EMAIL]
    markup = CallMarkup.of(fmt, USER, tools, "send_email")
    assert required_prefill([markup, CallMarkup.of(fmt, USER, tools, "get_weather")]) == \
        '<tool_call>\n{"name": "'
    # `"send_email"` alone would split the `",` token the model was trained on.
    assert markup.named_prefill() == '<tool_call>\n{"name": "send_email", "arguments":'
    assert markup.closing == "</tool_call>"
    prompt = fmt.render_text(USER, tools)
    for prefill in (required_prefill([markup]), markup.named_prefill()):
        demo = fmt.reply_text(USER, {"content": None, "tool_calls": [
            {"type": "function", "function": {"name": "send_email", "arguments": {"to": "a"}}}]},
            tools)
        sampled = fmt.encode(prompt + prefill)
        assert (fmt.encode(prompt) + fmt.encode(demo))[:len(sampled)] == sampled


def test_a_function_named_like_the_markup(fmt: ChatFormat) -> None:
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("call", "name")]
    for name in ("call", "name"):
        markup = CallMarkup.of(fmt, USER, tools, name)
        assert markup.named_prefill() == f'<tool_call>\n{{"name": "{name}", "arguments":'
    assert required_prefill([CallMarkup.of(fmt, USER, tools, n) for n in ("call", "name")]) \
        == '<tool_call>\n{"name": "'


def test_decoding_per_tool_choice(fmt: ChatFormat) -> None:
    tools = [WEATHER, EMAIL]
    auto = decoding(fmt, USER, tools, "auto", parallel=True)
    assert (auto.prefill, auto.stop, auto.parse_calls, auto.max_calls) == ("", (), True, None)
    assert auto.tools == tools
    none = decoding(fmt, USER, tools, "none", parallel=True)
    assert (none.prefill, none.parse_calls, none.tools) == ("", False, tools)  # still rendered
    assert not decoding(fmt, USER, None, "none", parallel=True).parse_calls
    single = decoding(fmt, USER, tools, "auto", parallel=False)
    assert (single.stop, single.max_calls) == (("</tool_call>",), 1)
    assert auto.grammar is None and single.grammar is None  # auto: the gate's, unconstrained
    required = decoding(fmt, USER, tools, "required", parallel=True)
    assert required.prefill == '<tool_call>\n{"name": "' and required.stop == ()
    # the rest under the grammar: an offered name, its arguments' schema, more calls or the end
    assert required.grammar is not None and required.max_calls is None
    assert '"get_weather\\", \\"arguments\\": "' in required.grammar
    assert '"send_email\\", \\"arguments\\": "' in required.grammar
    assert "(\"\\n\" call)*" in required.grammar
    one = decoding(fmt, USER, tools, "required", parallel=False)
    assert one.max_calls == 1 and "call)*" not in (one.grammar or "")
    named = decoding(fmt, USER, tools, "function:get_weather", parallel=True)
    assert named.prefill.endswith('"get_weather", "arguments":') and named.max_calls == 1
    # the grammar ends the turn after the one call: no stop string needed
    assert named.stop == () and named.grammar is not None and "send_email" not in named.grammar


def _answer(fmt: ChatFormat, choice: str, text: str, *, parallel: bool = True,
            finish: str = "stop", stops: tuple[str, ...] = ()) -> tuple[dict[str, Any], str]:
    d = decoding(fmt, USER, [WEATHER, EMAIL], choice, parallel)
    return answer(fmt, d, text, finish, stops, id_prefix="call_x_")


def _calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls", [])]


def test_answers(fmt: ChatFormat) -> None:
    two = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "send_email", "arguments": {"to": "a@b.c"}}\n</tool_call>')
    message, finish = _answer(fmt, "auto", two)
    assert finish == "tool_calls" and message["content"] is None
    assert _calls(message) == [("get_weather", {"city": "Oslo"}), ("send_email", {"to": "a@b.c"})]
    assert [c["id"] for c in message["tool_calls"]] == ["call_x_0", "call_x_1"]
    assert all(c["type"] == "function" for c in message["tool_calls"])

    # required: the model continues the prefill; the parse sees prefill + text.
    message, finish = _answer(fmt, "required", 'get_weather", "arguments": {"city": "Rome"}}\n'
                                               "</tool_call>")
    assert finish == "tool_calls" and _calls(message) == [("get_weather", {"city": "Rome"})]
    message, _ = _answer(fmt, "function:send_email", ' {"to": "x@y.z"}}\n</tool_call>',
                         parallel=True)
    assert _calls(message) == [("send_email", {"to": "x@y.z"})]

    # none: call markup the model writes anyway stays text.
    message, finish = _answer(fmt, "none", two)
    assert finish == "stop" and "tool_calls" not in message and message["content"] == two

    # at most one call without parallel calls
    message, finish = _answer(fmt, "auto", two, parallel=False)
    assert finish == "tool_calls" and len(message["tool_calls"]) == 1

    # text, a request's own stop sequence left out, length
    message, finish = _answer(fmt, "auto", "It is sunny.\n\n", stops=("\n\n",))
    assert (message["content"], finish) == ("It is sunny.", "stop")
    message, finish = _answer(fmt, "auto", "It is sunny and", finish="length")
    assert (message["content"], finish) == ("It is sunny and", "length")

    # a malformed call is returned as text (with the prefill), never half-parsed
    message, finish = _answer(fmt, "required", 'get_weather", "arguments": {"city": ',
                              finish="length")
    assert finish == "length" and "tool_calls" not in message
    assert message["content"].startswith('<tool_call>\n{"name": "get_weather"')


# -- streaming --------------------------------------------------------------------------------

def test_pieces_reassemble() -> None:
    for text in ("", "  lead", "a b\n c ", '{"city": "Zürich"}'):
        assert "".join(pieces(text)) == text


def test_stream_chunks_assemble_the_answer() -> None:
    calls = [{"id": "call_a_0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "call_a_1", "type": "function",
              "function": {"name": "send_email", "arguments": '{"to": "a b"}'}}]
    response = {"id": "chatcmpl-1", "created": 7, "model": "policy@v2",
                "system_fingerprint": "fp", "usage": {"prompt_tokens": 3,
                                                      "completion_tokens": 4, "total_tokens": 7},
                "choices": [
                    {"index": 0, "finish_reason": "tool_calls", "message": {
                        "role": "assistant", "content": "Checking both.", "tool_calls": calls}},
                    {"index": 1, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Sunny."}}]}
    out = list(chunks(response, include_usage=True))
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "policy@v2"
               for c in out)
    assert out[-1]["choices"] == [] and out[-1]["usage"] == response["usage"]
    assert all(c["usage"] is None for c in out[:-1])
    got: dict[int, dict[str, Any]] = {}
    finish: dict[int, str] = {}
    for c in out[:-1]:
        (choice,) = c["choices"]
        acc = got.setdefault(choice["index"], {"content": "", "tool_calls": {}})
        delta = choice["delta"]
        if "role" in delta:
            assert delta["role"] == "assistant"
        acc["content"] += delta.get("content") or ""
        for tc in delta.get("tool_calls", []):
            slot = acc["tool_calls"].setdefault(tc["index"], {"arguments": ""})
            if "id" in tc:
                slot.update(id=tc["id"], name=tc["function"]["name"], type=tc["type"])
            slot["arguments"] += tc["function"]["arguments"]
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert finish == {0: "tool_calls", 1: "stop"}
    assert got[0]["content"] == "Checking both." and got[1]["content"] == "Sunny."
    assert [{"id": s["id"], "type": s["type"], "function": {
        "name": s["name"], "arguments": s["arguments"]}} for s in got[0]["tool_calls"].values()
            ] == calls
    text = "".join(events(response, include_usage=False))
    assert text.endswith("data: [DONE]\n\n") and '"usage"' not in text


def test_a_cut_parallel_answer_keeps_its_complete_calls(fmt: ChatFormat) -> None:
    """Under the grammar every closed call is well-formed: cut by `max_tokens` inside a later
    call, the complete ones are the answer (`finish_reason` still `length`)."""
    text = ('get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro')
    message, finish = _answer(fmt, "required", text, finish="length")
    assert finish == "length" and _calls(message) == [("get_weather", {"city": "Rome"})]
    message, finish = _answer(fmt, "required", 'get_weather", "arguments": {"ci',
                              finish="length")
    assert finish == "length" and "tool_calls" not in message  # no call was finished
