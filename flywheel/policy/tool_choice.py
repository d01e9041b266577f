"""What each `tool_choice` means on Flywheel's engines, and how a completion becomes an answer.

Serving renders and parses exactly as rollouts and the gate do (the policy's `ChatFormat`);
`tool_choice` only adds what it must, the same on the local engine and on vLLM:

* `auto` (the default with tools): the gate's own decoding — the prompt rendered with the
  tools, no prefill, no stop but the end-of-turn token, the reply read by `ChatFormat.parse`.
  This is the mode the gate's figures describe.
* `none`: the same prompt (the tools stay rendered, as vLLM renders them for `none`: the
  conversation and the prefix cache do not change under the agent), and the reply is returned
  as text, never parsed into calls: if the model writes call markup anyway it is in `content`.
* `required`: the assistant turn is prefilled with the template's call opening (bundled
  template: `<tool_call>\\n{"name": "`); the model picks the function and its arguments, and
  the reply is parsed with the prefill in front, so the parse sees the whole call.
* `{"type": "function", "function": {"name": N}}`: the prefill runs through the name, up to
  the arguments (`<tool_call>\\n{"name": "N", "arguments":`); one call to N is returned.
* `parallel_tool_calls: false` (and a named choice): generation stops after the first call's
  closing tag (`</tool_call>`) and at most one call is returned.

The prefill and the closing tag are read off the template itself (a rendered one-call reply),
so a model's own tool template works too. A prefill is cut back to a token boundary of what
training saw (`ids(prompt + prefill)` is a prefix of `ids(prompt) + ids(reply)`), so the model
continues a token sequence it was trained on. `required`/named guarantee the opening of a
call, not a well-formed one: a call the model leaves malformed comes back as `content`
(vLLM's parser does the same).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from flywheel.policy.chat_format import ChatFormat, ChatFormatError

_PROBE_ARG = "flywheel_probe_argument"


@dataclass(frozen=True)
class Decoding:
    """How one request is sampled and read back."""

    choice: str
    """`none`, `auto`, `required` or `function:<name>`."""
    tools: list[dict[str, Any]] | None
    """Rendered into the prompt."""
    prefill: str = ""
    stop: tuple[str, ...] = ()
    """Our stop strings (kept in the text, which the parse needs)."""
    parse_calls: bool = True
    max_calls: int | None = None


def decoding(fmt: ChatFormat, messages: Sequence[Mapping[str, Any]],
             tools: list[dict[str, Any]] | None, choice: str, parallel: bool) -> Decoding:
    if not tools or choice == "none":
        return Decoding(choice, tools, parse_calls=False)
    single = not parallel or choice.startswith("function:")
    if choice == "auto" and not single:
        return Decoding(choice, tools)  # the gate's decoding: nothing to read off the template
    names = [choice.removeprefix("function:")] if choice.startswith("function:") else \
        [str(t["function"]["name"]) for t in tools]
    markups = [CallMarkup.of(fmt, messages, tools, name) for name in names]
    closing = markups[0].closing
    stop = (closing,) if single and closing else ()
    if choice == "auto":
        return Decoding(choice, tools, stop=stop, max_calls=1 if single else None)
    prefill = required_prefill(markups) if choice == "required" else markups[0].named_prefill()
    return Decoding(choice, tools, prefill=prefill, stop=stop, max_calls=1 if single else None)


def required_prefill(markups: Sequence[CallMarkup]) -> str:
    """The call opening up to the function name (the same text for every tool), cut back
    until it ends on a token boundary of every tool's rendered call."""
    first = markups[0]
    for end in range(first.name_start, 0, -1):
        if all(m.reply[:end] == first.reply[:end] and m.on_boundary(end) for m in markups):
            return first.reply[:end]
    return first.reply[:first.name_start]


@dataclass(frozen=True)
class CallMarkup:
    """Where a one-call reply rendered by the template opens, names, and closes its call."""

    fmt: ChatFormat
    prompt: str
    reply: str
    name_start: int
    name_end: int
    arguments_start: int
    closing: str | None
    """The tag that ends a call (`</tool_call>`), None when the template writes none."""

    @classmethod
    def of(cls, fmt: ChatFormat, messages: Sequence[Mapping[str, Any]],
           tools: list[dict[str, Any]], name: str) -> CallMarkup:
        def rendered(fn: str) -> str:
            call = {"type": "function", "function": {"name": fn, "arguments": {_PROBE_ARG: 1}}}
            return fmt.reply_text(messages, {"content": None, "tool_calls": [call]}, tools)

        reply = rendered(name)
        # Where the name starts: where a call to another name (first letter differs) departs.
        other = rendered("qx_probe" if not name.startswith("q") else "xq_probe")
        name_start = next((i for i, (a, b) in enumerate(zip(reply, other, strict=False))
                           if a != b), min(len(reply), len(other)))
        probe = reply.find(f'"{_PROBE_ARG}"')
        arguments_start = reply.rfind("{", 0, probe)
        if reply[name_start:name_start + len(name)] != name or probe < 0 \
                or not name_start + len(name) <= arguments_start:
            raise ChatFormatError(f"{fmt.name}: a rendered call does not write the function "
                                  f"name before its arguments ({reply!r}); tool_choice "
                                  "'required' or a named function cannot be served with it")
        _, arguments_end = json.JSONDecoder().raw_decode(reply, arguments_start)
        tail = reply[arguments_end:].removesuffix(fmt.end_of_turn).split()
        closing = tail[-1] if tail and any(ch.isalpha() for ch in tail[-1]) else None
        return cls(fmt, fmt.render_text(messages, tools), reply, name_start,
                   name_start + len(name), arguments_start, closing)

    def named_prefill(self) -> str:
        """The call through its function name, up to the arguments, on a token boundary."""
        for end in range(self.arguments_start, self.name_end - 1, -1):
            if self.on_boundary(end):
                return self.reply[:end]
        return self.reply[:self.arguments_start]

    @cached_property
    def _trained(self) -> list[int]:
        # SFT tokenizes the prompt and the reply separately (`ChatFormat.encode_reply`).
        return self.fmt.encode(self.prompt) + self.fmt.encode(self.reply)

    def on_boundary(self, end: int) -> bool:
        """`ids(prompt + reply[:end])` is a prefix of what SFT trained on. The engines encode
        `prompt + prefill` as one text."""
        sampled = self.fmt.encode(self.prompt + self.reply[:end])
        return self._trained[:len(sampled)] == sampled


def answer(fmt: ChatFormat, d: Decoding, text: str, engine_finish: str,
           user_stops: Sequence[str], id_prefix: str) -> tuple[dict[str, Any], str]:
    """The OpenAI assistant message and `finish_reason` for one completion's `text` (the
    generated text, without the prefill; `engine_finish` is `stop` or `length`)."""
    for stop in user_stops:
        # OpenAI leaves a request's stop sequence out of the text; ours stay (the parse reads them).
        if stop not in d.stop and engine_finish == "stop" and text.endswith(stop):
            text = text[:-len(stop)]
            break
    calls: list[dict[str, Any]] = []
    if d.parse_calls:
        parsed = fmt.parse(d.prefill + text, id_prefix=id_prefix)
        calls = parsed["tool_calls"][:d.max_calls]
        content = parsed["content"]
    else:
        content = d.prefill + text
    message: dict[str, Any] = {"role": "assistant",
                               "content": content if content or not calls else None,
                               "refusal": None}
    if calls:
        message["tool_calls"] = calls
        return message, "tool_calls"
    message["content"] = content or ""
    return message, "length" if engine_finish == "length" else "stop"
