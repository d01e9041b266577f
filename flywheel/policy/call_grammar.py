"""The grammar a `required` or named `tool_choice` is decoded under: the chat format's own call
markup around a JSON object that names an offered tool and whose arguments match its schema.

Both engines sample under the same grammar text, in llguidance's Lark dialect
(https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md): the local engine
masks its logits with an `llguidance.LLMatcher` per row (`flywheel.policy.grammar_masks`);
vLLM gets it as `structured_outputs: {"grammar": ...}` and compiles it with its own
`guidance` backend (the same library). The grammar describes what comes *after* the prefill
(`tool_choice` prefills the call opening, which is part of the prompt on both engines) and
ends where the last call's markup closes: the end-of-turn token is then the only token the
model may write, so the turn ends there.

Every literal is read off the template (`tool_choice.CallMarkup`): what a rendered one-call
reply writes before the arguments (opening, name, key), after them (closing tag), between two
calls, and between the last call and the end of the turn. The arguments are `%json` with the
tool's `parameters` schema, written the way the template's `tojson` writes them (`", "` and
`": "`, no other whitespace), required keys first in `required` order (as the template's
examples show them; JSON key order means nothing to a reader of the call). An object schema
that lists `properties` and says nothing of `additionalProperties` gets no other keys (what
vLLM's `disable_additional_properties` does): a key the tool does not declare is a
hallucination, and a small model left free to add them writes keys until `max_tokens`. A
schema that sets `additionalProperties` keeps its own rule. Keywords llguidance does not
implement are ignored (`lenient`) rather than failing the request: its supported set is in
llguidance's docs/json_schema.md.

Pure text here; `check` imports llguidance (no torch) to compile the grammar once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": ", "lenient": True}
"""llguidance's JSON options (`x-guidance`): compact as `tojson` renders, lenient."""


class GrammarError(ValueError):
    """The call grammar cannot be built or compiled; the message says why."""


@dataclass(frozen=True)
class CallText:
    """One tool's call as the template writes it, split around the arguments."""

    lead: str
    """The reply up to the arguments (`<tool_call>\\n{"name": "f", "arguments": `)."""
    parameters: Mapping[str, Any] | None
    """The tool's JSON schema for its arguments (None: any object)."""
    after: str
    """From the end of the arguments through the call's closing tag (`}\\n</tool_call>`)."""


def arguments_schema(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """`parameters` as the `%json` schema: an object, required keys first, compact JSON."""
    schema = _declared_keys_only(parameters) if isinstance(parameters, Mapping) else {}
    schema.setdefault("type", "object")
    props, required = schema.get("properties"), schema.get("required")
    if isinstance(props, Mapping) and isinstance(required, list):
        first = [k for k in required if isinstance(k, str) and k in props]
        schema["properties"] = {**{k: props[k] for k in first},
                                **{k: v for k, v in props.items() if k not in first}}
    schema["x-guidance"] = dict(JSON_OPTIONS)
    return schema


def call_grammar(calls: Sequence[CallText], *, prefill: str, separator: str | None,
                 end: str) -> str:
    """The Lark grammar of a reply continuing `prefill`: one call to any of `calls`, then —
    with a `separator` (None: exactly one call) — any number more, then `end`.

    `prefill` must start every call's `lead` (it is the part of the first call the prompt
    already holds)."""
    if not calls:
        raise GrammarError("a call grammar needs at least one tool")
    rules = []
    first, later = [], []
    for i, call in enumerate(calls):
        if not call.lead.startswith(prefill):
            raise GrammarError(f"the prefill {prefill!r} does not open the call {call.lead!r}")
        rules.append(f"args_{i}: %json {json.dumps(arguments_schema(call.parameters))}")
        first.append(_seq(_literal(call.lead[len(prefill):]), f"args_{i}", _literal(call.after)))
        later.append(_seq(_literal(call.lead), f"args_{i}", _literal(call.after)))
    start = "first"
    if separator is not None:
        start += f" ({_seq(_literal(separator), 'call')})*"
        rules.insert(0, "call: " + " | ".join(later))
    start = _seq(start, _literal(end))
    return "\n".join(["%llguidance {}", f"start: {start}", "first: " + " | ".join(first),
                      *rules]) + "\n"


def check(grammar: str) -> None:
    """Compile `grammar` (no tokenizer: what vLLM checks too); `GrammarError` if it fails."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar))
    if error:
        raise GrammarError(f"the tools' call grammar does not compile: {error[:500]}")


_SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def _declared_keys_only(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `schema` where every object schema with `properties` and no
    `additionalProperties` allows only those keys."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMAS and isinstance(value, Mapping):
            value = _declared_keys_only(value)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [_declared_keys_only(v) if isinstance(v, Mapping) else v for v in value]
        elif key in _SCHEMA_MAPS and isinstance(value, Mapping):
            value = {k: _declared_keys_only(v) if isinstance(v, Mapping) else v
                     for k, v in value.items()}
        out[key] = value
    if isinstance(out.get("properties"), Mapping) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _literal(text: str) -> str:
    # Lark string literals are JSON strings in llguidance's dialect.
    return json.dumps(text, ensure_ascii=False) if text else ""


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)
