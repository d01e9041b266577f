"""The policy's chat format on the real SmolLM2 tokenizer: the bundled template's properties
(stock-identical without tools, round trip, prefix preservation, token boundary, generation
mask), the parser's edge cases, template selection, and a model's own template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from flywheel.policy import model_cache
from flywheel.policy.chat_format import (
    BUNDLED,
    ChatFormat,
    ChatFormatError,
    bundled_template,
    chat_format_for,
    openai_tools,
    renders_tools,
)

transformers = pytest.importorskip("transformers")

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "examples": ["Paris"]},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city"]}, "x-unsafe": False}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
USER = [{"role": "user", "content": "Weather in Oslo, and 3 + 4?"}]


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


REPLIES = {
    "one call": {"content": None, "tool_calls": [call("get_weather", city="Oslo")]},
    "two parallel calls": {"content": None, "tool_calls": [
        call("get_weather", city="Oslo", unit="celsius"), call("add", a=3, b=4)]},
    "text and a call": {"content": "Checking.", "tool_calls": [call("add", a=1, b=2)]},
    "text only": {"content": "It is sunny."},
    "unicode, quotes, nesting": {"content": None, "tool_calls": [call(
        "get_weather", city='Zürich "old" \\ town\nline', extra={"l": [1, 2.5, None, True]})]},
    "arguments as a JSON string": {"content": None, "tool_calls": [
        {"id": "call_9", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
    "empty arguments": {"content": None, "tool_calls": [call("add")]},
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    path = model_cache.default_model_dir(model_cache.default_cache_root())
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.fixture(scope="module")
def fmt(tokenizer: Any) -> ChatFormat:
    return chat_format_for(tokenizer, "auto")


def _calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for tc in message.get("tool_calls") or []:
        args = tc["function"]["arguments"]
        out.append((tc["function"]["name"], json.loads(args) if isinstance(args, str) else args))
    return out


# -- selection ---------------------------------------------------------------------------------

def test_smollm2_gets_the_bundled_template_because_its_own_ignores_tools(
        tokenizer: Any, fmt: ChatFormat) -> None:
    assert not renders_tools(tokenizer)
    assert fmt.name == BUNDLED and fmt.path == bundled_template().resolve()
    assert fmt.version.startswith(f"{BUNDLED}@") and len(fmt.version) == len(BUNDLED) + 13
    assert chat_format_for(tokenizer, BUNDLED).version == fmt.version
    assert chat_format_for(tokenizer, str(bundled_template())).version == fmt.version
    with pytest.raises(ChatFormatError, match="does not render tools"):
        chat_format_for(tokenizer, "model")
    with pytest.raises(ChatFormatError, match="no bundled chat template"):
        chat_format_for(tokenizer, "nope.v9")


def test_a_model_with_its_own_tool_template_and_response_template_needs_no_files(
        tokenizer: Any, fmt: ChatFormat, tmp_path: Path) -> None:
    """A tokenizer directory that carries a tool-capable chat template and a response
    template (like Qwen's) is used as it is, under `auto` and `model`."""
    src = model_cache.default_model_dir(model_cache.default_cache_root())
    own = tmp_path / "own"
    own.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, own / name)
    tok = transformers.AutoTokenizer.from_pretrained(src, local_files_only=True)
    tok.chat_template = fmt.template.replace("named SmolLM", "named Own")
    tok.response_template = fmt.response_template
    tok.save_pretrained(own)
    reloaded = transformers.AutoTokenizer.from_pretrained(own, local_files_only=True)
    for setting in ("auto", "model"):
        mine = chat_format_for(reloaded, setting)
        assert mine.name == "model" and mine.path is None and mine.version != fmt.version
        assert "named Own" in mine.render_text(USER, TOOLS)
        reply = mine.reply_text(USER, REPLIES["two parallel calls"], TOOLS)
        assert _calls(mine.parse(reply)) == _calls(REPLIES["two parallel calls"])


def test_a_template_file_without_a_response_template_is_refused(tokenizer: Any,
                                                                tmp_path: Path) -> None:
    path = tmp_path / "mine.jinja"
    path.write_text(bundled_template().read_text())
    with pytest.raises(ChatFormatError, match="no response template"):
        chat_format_for(tokenizer, str(path))
    (tmp_path / "mine.response.json").write_text(
        (bundled_template().parent / f"{BUNDLED}.response.json").read_text())
    copy = chat_format_for(tokenizer, str(path))  # a copy of the bundled one is the same format
    assert (copy.name, copy.version, copy.path) == (BUNDLED, fmt_version(tokenizer), path)
    path.write_text(bundled_template().read_text().replace("named SmolLM", "named Mine"))
    mine = chat_format_for(tokenizer, str(path))
    assert mine.name == "mine" and mine.version != fmt_version(tokenizer)


def fmt_version(tokenizer: Any) -> str:
    return chat_format_for(tokenizer).version


def test_write_puts_both_templates_where_a_server_can_read_them(fmt: ChatFormat,
                                                                tmp_path: Path) -> None:
    fmt.write(tmp_path / "volume" / "chat-template.jinja")
    assert (tmp_path / "volume" / "chat-template.jinja").read_text() == fmt.template
    assert json.loads((tmp_path / "volume" / "chat-template.response.json").read_text()) \
        == fmt.response_template


# -- the bundled template's properties ------------------------------------------------------------

@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
     {"role": "assistant", "content": "a"}],
    [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
     {"role": "user", "content": "u2"}],
])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_without_tools_it_renders_byte_for_byte_like_the_stock_template(
        tokenizer: Any, fmt: ChatFormat, messages: list[dict[str, Any]],
        generation_prompt: bool) -> None:
    stock = tokenizer.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=generation_prompt)
    for tools in (None, []):
        assert fmt.render_text(messages, tools, add_generation_prompt=generation_prompt) == stock


def test_the_tools_block_does_not_depend_on_who_built_or_stored_the_tool(
        fmt: ChatFormat) -> None:
    """Flat (stored) or nested (OpenAI) tools, nulls, extra keys, reordered keys (Postgres
    jsonb reorders object keys): one rendering."""
    nested = {"function": {"strict": None, "parameters": {
        "required": ["city"], "type": "object", "properties": {
            "unit": {"enum": ["celsius", "fahrenheit"], "type": "string"},
            "city": {"examples": ["Paris"], "type": "string"}}},
        "description": "Weather for a city.", "name": "get_weather"}, "type": "function"}
    text = fmt.render_text(USER, [WEATHER])
    assert fmt.render_text(USER, [nested]) == text
    assert "x-unsafe" not in text and "strict" not in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text  # the example
    assert openai_tools([WEATHER]) == openai_tools([nested]) == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city.",
        "parameters": WEATHER["parameters"]}}]


@pytest.mark.parametrize("name", list(REPLIES))
def test_render_then_parse_gives_the_reply_back(fmt: ChatFormat, name: str) -> None:
    reply = REPLIES[name]
    text = fmt.reply_text(USER, reply, TOOLS)
    assert text.endswith("<|im_end|>")
    for generated in (text, text.removesuffix("<|im_end|>")):  # local keeps EOS; vLLM drops it
        parsed = fmt.parse(generated)
        assert "parse_error" not in parsed
        assert _calls(parsed) == _calls(reply)
        assert parsed["content"] == reply.get("content")
        assert [c["id"] for c in parsed["tool_calls"]] == [
            f"call_{i}" for i in range(len(reply.get("tool_calls", [])))]
    # The parsed message renders as the original did: a re-render is stable.
    assert fmt.reply_text(USER, fmt.parse(text), TOOLS) == text


@pytest.mark.parametrize("name", list(REPLIES))
def test_token_boundary_and_generation_mask(fmt: ChatFormat, tokenizer: Any, name: str
                                            ) -> None:
    """ids(prompt) + ids(reply) == ids(whole conversation), and the template's generation
    span is exactly the reply (content, calls, <|im_end|>): SFT trains what sampling makes."""
    reply = {"role": "assistant", **REPLIES[name]}
    prompt, completion = fmt.render(USER, TOOLS), fmt.encode_reply(USER, reply, TOOLS)
    whole = fmt.encode(fmt.render_text([*USER, reply], TOOLS, add_generation_prompt=False))
    assert whole == prompt + completion + fmt.encode("\n")
    assert completion[-1] == tokenizer.eos_token_id
    enc = tokenizer.apply_chat_template(
        [*USER, reply], tools=openai_tools(TOOLS), chat_template=fmt.template, tokenize=True,
        return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m]
    assert masked == completion


def test_prefix_preserving_at_every_message_boundary(fmt: ChatFormat) -> None:
    conversation = [
        *USER, {"role": "assistant", **REPLIES["two parallel calls"]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temp_c": 3}'},
        {"role": "tool", "tool_call_id": "call_1", "content": {"sum": 7}},
        {"role": "assistant", "content": "3 °C in Oslo; 3 + 4 = 7."},
        {"role": "user", "content": "And Rome?"},
        {"role": "assistant", **REPLIES["one call"]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18"},
    ]
    for tools in (None, [WEATHER], TOOLS):
        for k in range(1, len(conversation)):
            before = fmt.render_text(conversation[:k], tools, add_generation_prompt=False)
            after = fmt.render_text(conversation[:k + 1], tools, add_generation_prompt=False)
            assert after.startswith(before), (k, tools)
            if conversation[k]["role"] == "assistant":  # the prompt it was sampled after
                prompt = fmt.render(conversation[:k], tools)
                assert fmt.encode(after)[:len(prompt)] == prompt
    assert '<tool_response>\n{"sum": 7}\n</tool_response>' in after  # results as JSON text


# -- parsing edge cases ---------------------------------------------------------------------------

C = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
D = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("It is sunny.<|im_end|>", "It is sunny.", []),
    ("It is sunny.", "It is sunny.", []),
    ("", None, []),
    ("<|im_end|>", None, []),
    (f"<tool_call>\n{C}\n</tool_call><|im_end|>", None, [("get_weather", {"city": "Oslo"})]),
    (f"<tool_call>{C}</tool_call>", None, [("get_weather", {"city": "Oslo"})]),
    (f"<tool_call>\n{C}\n</tool_call>\n<tool_call>\n{D}\n</tool_call><|im_end|>", None,
     [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]),
    (f"Sure.\n<tool_call>\n{C}\n</tool_call><|im_end|>", "Sure.",
     [("get_weather", {"city": "Oslo"})]),
    (f"<tool_call>\n{C}\n</tool_call>\nDone!<|im_end|>", "Done!",
     [("get_weather", {"city": "Oslo"})]),
    (f"<tool_call>\n{C}\n<|im_end|>", None, [("get_weather", {"city": "Oslo"})]),
    ('<tool_call>\n{"name": "add"}\n</tool_call>', None, [("add", {})]),
    ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None,
     [("add", {"a": 1})]),
    ('<tool_call>\n{"name": "add", "arguments": {"a": "7"}}\n</tool_call>', None,
     [("add", {"a": "7"})]),  # never cast by the schema: the verifier judges types
    (f"<tool_call>\n{C}\n</tool_call><|im_end|>\n<|im_start|>user\nhi", None,
     [("get_weather", {"city": "Oslo"})]),
])
def test_parse(fmt: ChatFormat, text: str, content: str | None,
               calls: list[tuple[str, dict[str, Any]]]) -> None:
    parsed = fmt.parse(text)
    assert "parse_error" not in parsed and parsed["role"] == "assistant"
    assert (parsed["content"], _calls(parsed)) == (content, calls)
    for tc in parsed["tool_calls"]:
        assert isinstance(tc["function"]["arguments"], str)  # OpenAI: a JSON string


@pytest.mark.parametrize(("text", "why"), [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": Oslo}}\n</tool_call>',
     "could not be parsed"),
    (f'<tool_call>\n{C}\n</tool_call>\n<tool_call>\n{{"name": "add"\n</tool_call>',
     "could not be parsed"),
    ('<tool_call>\n{"name": "get_weather", "argu', "could not be parsed"),  # max_tokens cut
    ("<tool_call>\n[1, 2]\n</tool_call>", "not a call object"),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', 'string "name"'),
    ('<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>', "must be a JSON object"),
    ('<tool_call>\n{"name": "add", "arguments": "{oops"}\n</tool_call>', "not JSON"),
    ("Use the <tool_call> tag like this.", "could not be parsed"),
])
def test_a_malformed_reply_comes_back_as_text_with_the_reason(fmt: ChatFormat, text: str,
                                                              why: str) -> None:
    parsed = fmt.parse(text + "<|im_end|>")
    assert parsed["content"] == text and parsed["tool_calls"] == []
    assert why in parsed["parse_error"]


def test_the_verifier_scores_parsed_messages(fmt: ChatFormat) -> None:
    """What `parse` returns is what the tool_call verifier reads: calls, text, parse errors."""
    from flywheel.environments.tool_call import verify_output
    from flywheel.tasks import ExpectedCall, ToolCallSpec

    spec = ToolCallSpec(expected=[ExpectedCall(name="get_weather", arguments={"city": "Oslo"})])
    good = verify_output(spec, fmt.parse(f"<tool_call>\n{C}\n</tool_call>"), [WEATHER])
    assert (good.reward, good.failure_mode) == (1.0, None)
    bad = verify_output(spec, fmt.parse('<tool_call>\n{"name": "get_w'), [WEATHER])
    assert (bad.reward, bad.failure_mode) == (0.0, "invalid_format")
    prose = verify_output(spec, fmt.parse("It is sunny in Oslo."), [WEATHER])
    assert (prose.reward, prose.failure_mode) == (0.0, "invalid_format")


def test_ids_follow_the_prefix_given(fmt: ChatFormat) -> None:
    parsed = fmt.parse(f"<tool_call>\n{C}\n</tool_call>\n<tool_call>\n{D}\n</tool_call>",
                       id_prefix="call_2_")
    assert [c["id"] for c in parsed["tool_calls"]] == ["call_2_0", "call_2_1"]
