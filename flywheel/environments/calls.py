"""Parsed model outputs → the tool calls they make (pure).

What the chat format's response parser hands over is an OpenAI-style assistant message::

    {"role": "assistant", "content": str | None,
     "tool_calls": [{"id": …, "type": "function",
                     "function": {"name": …, "arguments": <JSON string or object>}}]}

A message whose text could not be parsed carries the reason instead of calls:
`{"role": "assistant", "content": <raw text>, "tool_calls": [], "parse_error": "<why>"}`.
A bare list of calls (each OpenAI-style, or flat `{"name" | "tool", "arguments"}`) and one
such call on its own are accepted too. `arguments` that are not JSON, or not a JSON object,
make the output malformed: no deployed tool runtime would run that call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


class MalformedOutput(ValueError):
    """The output is not a list of well-formed calls; the message says what is wrong."""


class EmptyOutput(ValueError):
    """The output holds neither text nor calls: an abstention (scored `empty`)."""


def _arguments(raw: object, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if isinstance(raw, str):
        if not raw.strip():
            return {}
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise MalformedOutput(f"{where}: arguments are a string but not JSON ({exc}); "
                                  f"send a JSON object such as {{\"city\": \"Oslo\"}}") from None
    if not isinstance(raw, dict):
        raise MalformedOutput(f"{where}: arguments must be a JSON object, got "
                              f"{type(raw).__name__}")
    return raw


def call_of(item: object, index: int = 0) -> Call:
    """One call: `{"function": {"name", "arguments"}}` (OpenAI) or `{"name", "arguments"}`."""
    where = f"call #{index + 1}"
    if not isinstance(item, Mapping):
        raise MalformedOutput(f"{where} must be an object, got {type(item).__name__}")
    body = item["function"] if isinstance(item.get("function"), Mapping) else item
    name = body.get("name", body.get("tool"))
    if not isinstance(name, str) or not name.strip():
        raise MalformedOutput(f'{where} needs a string "name" naming the tool')
    return Call(name.strip(), _arguments(body.get("arguments"), f"{where} ({name.strip()})"))


def calls_of(items: Sequence[object]) -> list[Call]:
    return [call_of(item, n) for n, item in enumerate(items)]


def is_message(output: Mapping[str, Any]) -> bool:
    return any(k in output for k in ("role", "tool_calls", "parse_error"))


def calls_of_message(message: Mapping[str, Any]) -> list[Call]:
    """The calls of an assistant message ([] when it answered in text only).

    Raises `MalformedOutput` for a parse failure the message reports or a malformed call,
    and `EmptyOutput` when the message holds neither text nor calls.
    """
    role = message.get("role", "assistant")
    if role != "assistant":
        raise MalformedOutput(f"expected the assistant's message, got role {role!r}")
    if message.get("parse_error"):
        raise MalformedOutput(f"the response could not be parsed: {message['parse_error']}")
    raw = message.get("tool_calls") or []
    if not isinstance(raw, list):
        raise MalformedOutput(f"tool_calls must be a list, got {type(raw).__name__}")
    content = message.get("content")
    if not raw and not (isinstance(content, str) and content.strip()):
        raise EmptyOutput("the assistant message has neither text nor tool calls")
    return calls_of(raw)


def output_calls(output: Mapping[str, Any] | Sequence[object]) -> list[Call]:
    """The calls of a parsed output: an assistant message, a list of calls, or one call."""
    if isinstance(output, Mapping):
        return calls_of_message(output) if is_message(output) else [call_of(output)]
    return calls_of(output)
