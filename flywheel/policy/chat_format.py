"""One chat format per policy: how a task is put to the model and how its reply is read.

Rollouts, the gate, the baseline, SFT demonstrations and serving all go through one
`ChatFormat`, so what is trained and gated is exactly what is served:

* `render(messages, tools)`: the prompt token ids (generation prompt added) from the chat
  template with OpenAI `tools`, the way TRL, vLLM and transformers render tool prompts;
* `parse(text)`: the model's text back into an OpenAI assistant message
  `{"role", "content", "tool_calls": [{"id", "type", "function": {"name", "arguments"}}]}`
  through the response template (`tokenizer.parse_response`). It never raises: a reply it
  cannot read comes back as its raw text with `tool_calls: []` and `parse_error`.

Which template (the `rollout.chat_template` setting): `auto` = the model's own when it renders
tools and the tokenizer has a response template, else the bundled `tool_chatml.v1` (SmolLM2's
ChatML plus Hermes-style `<tool_call>` blocks, which vLLM's stock `hermes` parser reads);
`model` = the model's own or an error; a bundled name or a `.jinja` path = that file, parsed
by the `<stem>.response.json` next to it (else the tokenizer's). vLLM must be started with
the same file: `--chat-template $(flywheel policy chat-template)`.

Importing this module imports no torch or transformers; `load_chat_format` loads a tokenizer
lazily.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).with_name("templates")
BUNDLED = "tool_chatml.v1"
RESPONSE_SUFFIX = ".response.json"
_PROBE_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "flywheel_probe", "description": "Probe.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                   "required": ["q"]}}}
_PROBE_CALLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "flywheel_probe",
                                                  "arguments": {"q": "a \"b\" é"}}},
                {"type": "function", "function": {"name": "flywheel_probe",
                                                  "arguments": {"q": "c"}}}]


class ChatFormatError(ValueError):
    """A chat template cannot serve as the policy's format; the message says how to fix it."""


def bundled_template(name: str = BUNDLED) -> Path:
    """The `.jinja` file of a template shipped with Flywheel (its response template beside it)."""
    path = TEMPLATES / f"{name}.jinja"
    if not path.is_file():
        known = sorted(p.name.removesuffix(".jinja") for p in TEMPLATES.glob("*.jinja"))
        raise ChatFormatError(f"no bundled chat template {name!r}; bundled: {known}")
    return path


def openai_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools in the Chat Completions shape `{"type": "function", "function": {name,
    description, parameters}}`, from that shape or Flywheel's stored flat one
    (`{"type": "function", "name", "parameters"}`); other keys (`x-unsafe`, `strict`) are
    dropped, so they never reach a prompt. None for no tools (some templates render
    boilerplate for `[]`)."""
    out = []
    for tool in tools or ():
        inner = tool.get("function")
        fn = inner if isinstance(inner, Mapping) else tool
        if not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"a tool needs a string name, got {dict(tool)!r}")
        out.append({"type": "function", "function": {
            k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}})
    return out or None


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them, the way vLLM hands them over: tool-call
    `arguments` as objects (OpenAI sends JSON strings), tool results as strings, no
    `parse_error` (it is ours, not the conversation's)."""
    return _conversation(messages, _object_arguments)


def api_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the Chat Completions API takes them: tool-call `arguments` as JSON
    strings, tool results as text, no Flywheel-only keys (`parse_error`)."""
    return _conversation(messages, _string_arguments)


def _conversation(messages: Sequence[Mapping[str, Any]],
                  call: Callable[[Mapping[str, Any]], dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if k != "parse_error"}
        if m.get("tool_calls"):
            m["tool_calls"] = [call(tc) for tc in m["tool_calls"]]
        if m.get("role") == "tool" and not isinstance(m.get("content"), str):
            m["content"] = json.dumps(m.get("content"), ensure_ascii=False)
        out.append(m)
    return out


def _object_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("arguments"), str):
        return dict(call)
    try:
        args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    except json.JSONDecodeError:
        return dict(call)  # rendered as sent; the template writes a string verbatim
    return {**call, "function": {**fn, "arguments": args}}


def _string_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, Mapping) or isinstance(fn.get("arguments"), str):
        return dict(call)
    return {**call, "function": {**fn, "arguments": json.dumps(fn.get("arguments") or {},
                                                               ensure_ascii=False)}}


class ChatFormat:
    """A tokenizer's chat template plus the response template that reads its replies.

    Safe to share between threads: the tokenizer is only used under a lock.
    """

    def __init__(self, tokenizer: Any, *, name: str, chat_template: str | None = None,
                 response_template: Mapping[str, Any] | None = None,
                 path: Path | None = None) -> None:
        template = chat_template if chat_template is not None else tokenizer.chat_template
        response = response_template if response_template is not None else \
            getattr(tokenizer, "response_template", None)
        if not isinstance(template, str) or not template:
            raise ChatFormatError(f"{name}: the tokenizer has no chat template")
        if not isinstance(response, Mapping):
            raise ChatFormatError(
                f"{name}: no response template to parse replies with; give the chat template "
                f"a <stem>{RESPONSE_SUFFIX} beside it, or use the bundled one "
                f"(rollout.chat_template: {BUNDLED})")
        self.tokenizer, self.name, self.path = tokenizer, name, path
        self.template: str = template
        self.response_template: dict[str, Any] = json.loads(json.dumps(response))
        digest = hashlib.sha256((template + "\0" + json.dumps(
            self.response_template, sort_keys=True)).encode()).hexdigest()[:12]
        self.version = f"{name}@{digest}"
        """Changes whenever the template or the response template does (gate cache keys)."""
        eot = tokenizer.eos_token
        self.end_of_turn: str = eot if isinstance(eot, str) else ""
        """What ends an assistant turn, as text (the EOS the engines stop at)."""
        self._lock = threading.Lock()
        self.generation_prefix = self._generation_prefix()
        """What the generation prompt pre-writes of the reply (the parser's `prefix`)."""
        self._self_check()

    # -- rendering -----------------------------------------------------------------------------
    def render_text(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None, *,
                    add_generation_prompt: bool = True) -> str:
        text = self.tokenizer.apply_chat_template(
            template_messages(messages), tools=openai_tools(tools),
            chat_template=self.template, add_generation_prompt=add_generation_prompt,
            tokenize=False)
        assert isinstance(text, str)
        return text

    def render(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Prompt token ids, generation prompt added: what every engine samples after."""
        return self.encode(self.render_text(messages, tools))

    def encode(self, text: str) -> list[int]:
        with self._lock:  # a fast tokenizer must not be used by two threads at once
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def reply_text(self, messages: Sequence[Mapping[str, Any]], reply: Mapping[str, Any],
                   tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The assistant message `reply` as the model writes it after `render(messages,
        tools)`: up to and including the end-of-turn token (the SFT target)."""
        prompt = self.render_text(messages, tools)
        full = self.render_text([*messages, {"role": "assistant", **reply}], tools,
                                add_generation_prompt=False)
        if not full.startswith(prompt):
            raise ChatFormatError(f"{self.name}: rendering a reply changes the prompt before "
                                  "it (the template is not prefix-preserving); SFT targets "
                                  "would not match what rollouts sample after")
        rest = full[len(prompt):]
        end = rest.find(self.end_of_turn) if self.end_of_turn else -1
        if end < 0:
            raise ChatFormatError(f"{self.name}: a rendered reply does not end with the "
                                  f"end-of-turn token {self.end_of_turn!r}")
        return rest[:end + len(self.end_of_turn)]

    def encode_reply(self, messages: Sequence[Mapping[str, Any]], reply: Mapping[str, Any],
                     tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """`reply_text` as token ids, tokenized on its own (as sampling produces it)."""
        return self.encode(self.reply_text(messages, reply, tools))

    # -- parsing -------------------------------------------------------------------------------
    def parse(self, text: str, *, prefix: str | None = None,
              id_prefix: str = "call_") -> dict[str, Any]:
        """The reply `text` (special tokens kept or not) as an OpenAI assistant message.

        Call ids are `id_prefix` + position, so parsing the same text twice gives the same
        ids. Malformed JSON in any call makes the whole reply unparsed (vLLM's hermes parser
        is all-or-nothing too): `{"content": <raw text>, "tool_calls": [], "parse_error"}`.
        Arguments are not cast by the tool schemas: the verifier checks their types.
        """
        if self.end_of_turn and self.end_of_turn in text:
            # One turn: what follows the first end-of-turn token is not part of this reply.
            text = text[:text.index(self.end_of_turn) + len(self.end_of_turn)]
        raw = text.removesuffix(self.end_of_turn) if self.end_of_turn else text
        try:
            msg = self.tokenizer.parse_response(
                text, self.response_template,
                prefix=self.generation_prefix if prefix is None else prefix)
        except (ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return _unparsed(raw, f"the reply could not be parsed: {first[:300]}")
        calls, problems = [], []
        raw_calls = msg.get("tool_calls") or []
        for n, item in enumerate(raw_calls if isinstance(raw_calls, list) else [raw_calls]):
            call = _call(item)
            if isinstance(call, str):
                problems.append(f"call #{n + 1}: {call}")
            else:
                calls.append({"id": f"{id_prefix}{n}", "type": "function", "function": {
                    "name": call[0], "arguments": json.dumps(call[1], ensure_ascii=False)}})
        if problems:
            return _unparsed(raw, "; ".join(problems)[:500])
        content = msg.get("content")
        out: dict[str, Any] = {k: v for k, v in msg.items()
                               if k not in ("role", "content", "tool_calls")}
        return {"role": "assistant",
                "content": content if isinstance(content, str) and content.strip() else None,
                "tool_calls": calls, **out}

    # -- internals -----------------------------------------------------------------------------
    def _generation_prefix(self) -> str:
        probe = [{"role": "user", "content": "x"}]
        with_prompt = self.render_text(probe)
        without = self.render_text(probe, add_generation_prompt=False)
        return with_prompt[len(without):] if with_prompt.startswith(without) else ""

    def _self_check(self) -> None:
        """The template renders tools and its replies parse back: else it is no tool format."""
        user = [{"role": "user", "content": "x"}]
        if "flywheel_probe" not in self.render_text(user, [_PROBE_TOOL]):
            raise ChatFormatError(f"{self.name}: the chat template does not render tools; use "
                                  f"the bundled one (rollout.chat_template: {BUNDLED}) or "
                                  "another tool-capable template")
        reply = {"content": None, "tool_calls": _PROBE_CALLS}
        parsed = self.parse(self.reply_text(user, reply, [_PROBE_TOOL]))
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
               for c in parsed["tool_calls"]]
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in _PROBE_CALLS]
        if got != want:
            raise ChatFormatError(f"{self.name}: the response template does not read back what "
                                  f"the chat template renders (sent {want}, parsed {parsed})")

    def write(self, path: Path) -> None:
        """Write the chat template to `path` and the response template beside it
        (`<stem>.response.json`): for a server that cannot run Flywheel (a vLLM image) to
        read with `--chat-template`. The model's own template is written too."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.template)
        path.with_name(path.name.removesuffix(".jinja") + RESPONSE_SUFFIX).write_text(
            json.dumps(self.response_template, indent=2) + "\n")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version,
                "path": None if self.path is None else str(self.path)}


def _call(item: object) -> tuple[str, dict[str, Any]] | str:
    """(name, arguments) of one parsed call, or what is wrong with it."""
    fn = item.get("function") if isinstance(item, Mapping) else None
    if not isinstance(fn, Mapping):
        return f"not a call object: {json.dumps(fn if fn is not None else item)[:100]}"
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        return 'needs a string "name"'
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return f'"arguments" is a string but not JSON ({exc})'
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f'"arguments" must be a JSON object, got {type(args).__name__}'
    return name.strip(), args


def _unparsed(raw: str, why: str) -> dict[str, Any]:
    return {"role": "assistant", "content": raw, "tool_calls": [], "parse_error": why}


def chat_format_for(tokenizer: Any, setting: str = "auto") -> ChatFormat:
    """The policy's format from its tokenizer and `rollout.chat_template` (see the module)."""
    if setting == "model":
        if not renders_tools(tokenizer):
            raise ChatFormatError(f"rollout.chat_template is 'model' but the model's chat "
                                  f"template does not render tools; use auto or {BUNDLED}")
        return ChatFormat(tokenizer, name="model")
    if setting == "auto":
        # A model whose own template renders tools keeps it (and then needs its response
        # template): swapping in SmolLM2's ChatML would change its system prompt and turns.
        if renders_tools(tokenizer):
            return ChatFormat(tokenizer, name="model")
        return _from_file(tokenizer, bundled_template(), BUNDLED)
    if not setting.endswith(".jinja") and "/" not in setting:
        return _from_file(tokenizer, bundled_template(setting), setting)
    path = Path(setting).expanduser()
    if not path.is_file():
        raise ChatFormatError(f"rollout.chat_template {setting!r} is not a file; use auto, "
                              f"model, a bundled name ({BUNDLED}) or a .jinja path")
    return _from_file(tokenizer, path, path.name.removesuffix(".jinja"))


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's own chat template puts tools into the prompt."""
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        return False
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                             tools=[_PROBE_TOOL], tokenize=False)
    except Exception:  # a third-party template may refuse tools in any way it likes
        return False
    return isinstance(text, str) and "flywheel_probe" in text


def _from_file(tokenizer: Any, path: Path, name: str) -> ChatFormat:
    response_file = path.with_name(path.name.removesuffix(".jinja") + RESPONSE_SUFFIX)
    response = json.loads(response_file.read_text()) if response_file.is_file() else None
    template = path.read_text()
    # A copy of a bundled template (e.g. written onto a volume for vLLM) is that template.
    name = next((p.name.removesuffix(".jinja") for p in sorted(TEMPLATES.glob("*.jinja"))
                 if p.read_text() == template), name)
    return ChatFormat(tokenizer, name=name, chat_template=template,
                      response_template=response, path=path.resolve())


def load_chat_format(model_dir: Path | str, setting: str = "auto") -> ChatFormat:
    """`chat_format_for` on a fresh tokenizer of `model_dir` (imports transformers)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return chat_format_for(tokenizer, setting)
