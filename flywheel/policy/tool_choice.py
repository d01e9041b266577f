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
  template: `<tool_call>\\n{"name": "`), and the rest is sampled under a grammar
  (`flywheel.policy.call_grammar`): the name of an offered tool, arguments that match its
  JSON schema, the closing tag — then, with parallel calls allowed, more calls or the end of
  the turn; without, the end of the turn. The reply is parsed with the prefill in front.
* `{"type": "function", "function": {"name": N}}`: the prefill runs through the name, up to
  the arguments (`<tool_call>\\n{"name": "N", "arguments":`); the arguments are sampled under
  N's schema, and the turn ends after that one call.
* `parallel_tool_calls: false`: `required` allows exactly one call; under `auto`, generation
  stops after the first call's closing tag (`</tool_call>`) and at most one call is returned.

The prefill, the markup the grammar writes and the closing tag are read off the template
itself (rendered replies), so a model's own tool template works too. A prefill is cut back to
a token boundary of what training saw (`ids(prompt + prefill)` is a prefix of
`ids(prompt) + ids(reply)`), so the model continues a token sequence it was trained on.
`required` and a named function always answer with well-formed calls to offered tools whose
arguments validate against their schemas — unless `max_tokens` cuts the first call short
(`finish_reason: length`, the text as `content`), as vLLM's structured outputs do; cut inside
a later parallel call, the complete calls before it are the answer (`finish_reason: length`).
`auto` is the gate's decoding, unconstrained: what the model writes is what the gate measured.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from flywheel.policy.call_grammar import CallText, GrammarError, call_grammar, check
from flywheel.policy.chat_format import ChatFormat, ChatFormatError, openai_tools

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
    grammar: str | None = None
    """What the completion (after the prefill) must match: `required` and named choices."""
    closing: str | None = None
    """The tag that ends a call, when decoding under the grammar (where a cut answer's last
    complete call ends)."""


def decoding(fmt: ChatFormat, messages: Sequence[Mapping[str, Any]],
             tools: list[dict[str, Any]] | None, choice: str, parallel: bool) -> Decoding:
    if not tools or choice == "none":
        return Decoding(choice, tools, parse_calls=False)
    single = not parallel or choice.startswith("function:")
    if choice == "auto" and not single:
        return Decoding(choice, tools)  # the gate's decoding: nothing to read off the template
    offered = openai_tools(tools) or []
    names = [choice.removeprefix("function:")] if choice.startswith("function:") else \
        [str(t["function"]["name"]) for t in offered]
    markups = [CallMarkup.of(fmt, messages, tools, name) for name in names]
    if choice == "auto":
        closing = markups[0].closing
        stop = (closing,) if single and closing else ()
        return Decoding(choice, tools, stop=stop, max_calls=1 if single else None)
    prefill = required_prefill(markups) if choice == "required" else markups[0].named_prefill()
    separator = None if single else markups[0].separator(messages, tools)
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in offered}
    try:
        grammar = call_grammar([CallText(m.reply[:m.arguments_start], schemas.get(name),
                                         m.reply[m.arguments_end:m.call_end])
                                for name, m in zip(names, markups, strict=True)],
                               prefill=prefill, separator=separator, end=markups[0].end)
        check(grammar)
    except GrammarError as err:
        raise ChatFormatError(str(err)) from err
    return Decoding(choice, tools, prefill=prefill, grammar=grammar,
                    max_calls=1 if separator is None else None, closing=markups[0].closing)


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
    arguments_end: int
    call_end: int
    """Where the call's markup ends (after its closing tag)."""
    closing: str | None
    """The tag that ends a call (`</tool_call>`), None when the template writes none."""

    @classmethod
    def of(cls, fmt: ChatFormat, messages: Sequence[Mapping[str, Any]],
           tools: list[dict[str, Any]], name: str) -> CallMarkup:
        def rendered(fn: str) -> str:
            return fmt.reply_text(messages, {"content": None, "tool_calls": [_probe(fn)]}, tools)

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
        body = reply.removesuffix(fmt.end_of_turn)
        tail = body[arguments_end:].split()
        closing = tail[-1] if tail and any(ch.isalpha() for ch in tail[-1]) else None
        call_end = body.rindex(closing) + len(closing) if closing else len(body)
        return cls(fmt, fmt.render_text(messages, tools), reply, name_start,
                   name_start + len(name), arguments_start, arguments_end, call_end, closing)

    @property
    def name(self) -> str:
        return self.reply[self.name_start:self.name_end]

    @property
    def end(self) -> str:
        """What the template writes between the last call and the end-of-turn token."""
        return self.reply[self.call_end:].removesuffix(self.fmt.end_of_turn)

    def separator(self, messages: Sequence[Mapping[str, Any]],
                  tools: list[dict[str, Any]]) -> str | None:
        """What the template writes between two calls (bundled: `\\n`), read off a rendered
        two-call reply; None when that reply is not this call twice around it (such a
        template's parallel calls are not expressed by the grammar: one call is allowed)."""
        two = self.fmt.reply_text(messages, {"content": None, "tool_calls": [
            _probe(self.name), _probe(self.name)]}, tools)
        call, rest = self.reply[:self.call_end], self.reply[self.call_end:]
        if len(two) < 2 * len(call) + len(rest) or not two.startswith(call) \
                or not two.endswith(call + rest):
            return None
        return two[len(call):len(two) - len(call) - len(rest)]

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


def _probe(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": {_PROBE_ARG: 1}}}


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
    if d.grammar is not None and d.closing and engine_finish == "length" \
            and (end := text.rfind(d.closing)) >= 0:
        # Cut inside a later call: the calls before it are complete and well-formed (the
        # grammar's); they are the answer, `finish_reason` still says it was cut.
        parsed = fmt.parse(d.prefill + text[:end + len(d.closing)], id_prefix=id_prefix)
        if parsed["tool_calls"]:
            return {"role": "assistant", "content": None, "refusal": None,
                    "tool_calls": parsed["tool_calls"][:d.max_calls]}, "length"
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
