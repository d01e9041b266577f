"""OpenTelemetry GenAI spans → wire format v1 dicts (pure): what instrumented agents export.

A trajectory is the spans of one conversation (`gen_ai.conversation.id`, OpenInference
`session.id`), else of one trace; its id is derived from that key (`trajectory_key`), so a
re-sent span or a late span of a finished trace lands on the same trajectory. Three ways of
writing the same content are read:

* the current GenAI conventions: `chat` spans with `gen_ai.input.messages`,
  `gen_ai.output.messages`, `gen_ai.system_instructions`, `gen_ai.tool.definitions`
  (messages of `parts`: `text`, `tool_call`, `tool_call_response`); `execute_tool` spans with
  `gen_ai.tool.name`, `gen_ai.tool.call.id`, `gen_ai.tool.call.arguments`,
  `gen_ai.tool.call.result`;
* the older event-based ones: span events `gen_ai.system.message`, `gen_ai.user.message`,
  `gen_ai.assistant.message`, `gen_ai.tool.message` and `gen_ai.choice`, their body in the
  attributes (`content`, `tool_calls`, `id`, `message`, or a JSON `gen_ai.event.content`);
* OpenInference: `llm.input_messages.N.message.*`, `llm.output_messages.N.message.*`,
  `llm.tools.N.tool.json_schema`, TOOL spans with `tool.name`, `input.value`, `output.value`.

Each chat span repeats the conversation so far; only what is new is appended. A tool span's
result becomes the `function_call_output` of its call unless a later chat span carried it.
The agent is `gen_ai.agent.name`, else the resource's `service.name`; usage is summed over
the chat spans. The outcome comes from the team's `flywheel.outcome.*` attributes on any
span (`status`, `reward`, `error`, `feedback`), else from the root span's status (ERROR →
`error`), else none: the trajectory awaits its outcome (feedback may name it by
`metadata.request_id`, the conversation or trace id).
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime
from typing import Any

from flywheel.formats import chat_to_items
from flywheel.ingest.storable import unstorable

OTEL_RECORD = "otel_spans"
"""The field of a record on the trajectories topic that holds one trajectory's spans."""
OTEL_NAMESPACE = uuid.UUID("0b6f3e0e-8a5c-4d1e-9c7a-2f4d6b8e1a33")
"""Namespace of span-derived trajectory ids (uuid5), fixed forever."""
STATUS_ERROR = 2
OUTCOME_PREFIX = "flywheel.outcome."
_HEX = re.compile(r"^[0-9a-f]+$")
_OI_INDEX = re.compile(r"^llm\.(input|output)_messages\.(\d+)\.message\.(.+)$")
_OI_CALL = re.compile(r"^tool_calls\.(\d+)\.tool_call\.(.+)$")


def is_otel(record: dict[str, Any]) -> bool:
    return OTEL_RECORD in record and "items" not in record


def conversation_of(span: dict[str, Any]) -> str | None:
    attrs = span.get("attributes") or {}
    for key in ("gen_ai.conversation.id", "session.id"):
        if isinstance(attrs.get(key), str) and attrs[key]:
            return str(attrs[key])
    return None


def trajectory_key(conversation: str | None, trace_id: str) -> str:
    return f"conversation:{conversation}" if conversation else f"trace:{trace_id}"


def trajectory_id(key: str) -> uuid.UUID:
    """The trajectory of a conversation or trace: `trajectory_id(trajectory_key(conv, trace))`."""
    return uuid.uuid5(OTEL_NAMESPACE, key)


def group_spans(spans: list[dict[str, Any]]) -> tuple[list[list[dict[str, Any]]], list[Any]]:
    """(one span list per trajectory, the spans that cannot be read) for spans that are all
    there (a file): a trace joins the conversation any of its spans names."""
    good = [s for s in spans if span_problem(s) is None]
    conv: dict[str, str] = {}
    for s in good:
        c = conversation_of(s)
        if c:
            conv.setdefault(s["trace_id"], c)
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in good:
        groups.setdefault(trajectory_key(conv.get(s["trace_id"]), s["trace_id"]), []).append(s)
    return list(groups.values()), [s for s in spans if span_problem(s) is not None]


def span_problem(span: Any) -> str | None:
    """Why one span cannot be read or stored, or None (the checks `spans_to_record` and
    ingest's boundary make)."""
    sid = span.get("span_id") if isinstance(span, dict) else None
    try:
        _check(span)
        _span_parts(span)
    except (ValueError, TypeError, KeyError) as err:
        return f"span {sid}: {err}"
    problem = unstorable(span)
    return None if problem is None else f"span {sid}: {problem}"


def _check(span: Any) -> None:
    if not isinstance(span, dict):
        raise ValueError("a span must be an object")
    for field, size in (("trace_id", 32), ("span_id", 16)):
        v = span.get(field)
        if not isinstance(v, str) or len(v) != size or not _HEX.match(v) or set(v) == {"0"}:
            raise ValueError(f"{field} must be {size} hex digits, not all zero; got {v!r}")
    for field in ("start_ns", "end_ns"):
        if not isinstance(span.get(field), int) or span[field] < 0:
            raise ValueError(f"{field} must be a non-negative integer")
    if span["end_ns"] and span["end_ns"] < span["start_ns"]:
        raise ValueError("the span ends before it starts")
    if not isinstance(span.get("attributes", {}), dict):
        raise ValueError("attributes must be an object")


def _json(value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError(f"{what} is not valid JSON") from None
    return value


def _args(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {})


def _semconv_message(msg: Any, what: str) -> list[dict[str, Any]]:
    """One GenAI `{role, parts}` message → Chat Completions messages (a tool response part
    is a `tool` message of its own)."""
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise ValueError(f"{what}: each message needs a 'role'")
    parts = msg.get("parts")
    if parts is None and "content" in msg:  # a chat-style message
        return [msg]
    if not isinstance(parts, list):
        raise ValueError(f"{what}: a message's 'parts' must be a list")
    text, calls, out = [], [], []
    for p in parts:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text":
            text.append(str(p.get("content", "")))
        elif kind == "tool_call":
            if not isinstance(p.get("name"), str):
                raise ValueError(f"{what}: a tool_call part needs a 'name'")
            calls.append({"id": p.get("id"), "type": "function",
                          "function": {"name": p["name"], "arguments": _args(p.get("arguments"))}})
        elif kind == "tool_call_response":
            resp = p.get("response")
            out.append({"role": "tool", "tool_call_id": p.get("id"),
                        "content": resp if isinstance(resp, str) else json.dumps(resp)})
    if text or calls or not out:
        role = "assistant" if calls else msg["role"]
        out.insert(0, {"role": role, "content": "".join(text) or None,
                       **({"tool_calls": calls} if calls else {})})
    return out


def _messages(value: Any, what: str) -> list[dict[str, Any]]:
    msgs = _json(value, what)
    if not isinstance(msgs, list):
        raise ValueError(f"{what} must be a JSON array of messages")
    return [m for msg in msgs for m in _semconv_message(msg, what)]


_USAGE = {"input_tokens": ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens",
                            "llm.token_count.prompt"),
          "output_tokens": ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens",
                            "llm.token_count.completion")}
_EVENT_ROLES = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
                "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}


def _event_message(event: dict[str, Any]) -> dict[str, Any] | None:
    name, attrs = event.get("name"), event.get("attributes") or {}
    body = _json(attrs.get("gen_ai.event.content", attrs), f"event {name}")
    if not isinstance(body, dict):
        raise ValueError(f"event {name}: its body must be an object")
    if name == "gen_ai.choice":
        body = _json(body.get("message", body), "gen_ai.choice message")
        role = "assistant"
    elif name in _EVENT_ROLES:
        role = _EVENT_ROLES[name]
    else:
        return None
    msg: dict[str, Any] = {"role": body.get("role") or role,
                           "content": _json_or_text(body.get("content"))}
    calls = _json(body.get("tool_calls"), f"event {name} tool_calls")
    if calls:
        msg["tool_calls"] = calls
    if role == "tool":
        msg["tool_call_id"] = body.get("id") or body.get("tool_call_id")
    return msg


def _json_or_text(v: Any) -> Any:
    return v if v is None or isinstance(v, str) else json.dumps(v)


def _openinference(attrs: dict[str, Any], direction: str) -> list[dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for key, value in attrs.items():
        m = _OI_INDEX.match(key)
        if m is None or m.group(1) != direction:
            continue
        msg = found.setdefault(int(m.group(2)), {})
        rest = m.group(3)
        call = _OI_CALL.match(rest)
        if call:
            calls = msg.setdefault("_calls", {})
            calls.setdefault(int(call.group(1)), {})[call.group(2)] = value
        else:
            msg[rest] = value
    out = []
    for _, msg in sorted(found.items()):
        chat: dict[str, Any] = {"role": msg.get("role", "assistant"),
                                "content": msg.get("content")}
        if msg.get("tool_call_id"):
            chat["tool_call_id"] = msg["tool_call_id"]
        calls = [c for _, c in sorted(msg.get("_calls", {}).items())]
        if calls:
            chat["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
                "name": c.get("function.name"), "arguments": _args(c.get("function.arguments"))}}
                for c in calls]
        out.append(chat)
    return out


def _span_parts(span: dict[str, Any]) -> tuple[str, list[Any], list[Any], list[Any]]:
    """(kind, input messages, output messages, tools) of one span; kind is `chat`, `tool`,
    `agent` or `other`."""
    attrs = span.get("attributes") or {}
    op = attrs.get("gen_ai.operation.name") or str(attrs.get("openinference.span.kind", "")
                                                   ).lower()
    tools: list[Any] = []
    if "gen_ai.tool.definitions" in attrs:
        tools = _json(attrs["gen_ai.tool.definitions"], "gen_ai.tool.definitions")
        if not isinstance(tools, list):
            raise ValueError("gen_ai.tool.definitions must be a JSON array")
    tools += [_json(v, k) for k, v in sorted(attrs.items())
              if k.startswith("llm.tools.") and k.endswith(".tool.json_schema")]
    if op in ("execute_tool", "tool"):
        return "tool", [], [], tools
    if op in ("invoke_agent", "create_agent", "agent"):
        return "agent", [], [], tools
    inputs: list[Any] = []
    if "gen_ai.system_instructions" in attrs:
        parts = _json(attrs["gen_ai.system_instructions"], "gen_ai.system_instructions")
        inputs += _semconv_message({"role": "system", "parts": parts}, "system instructions")
    if "gen_ai.input.messages" in attrs:
        inputs += _messages(attrs["gen_ai.input.messages"], "gen_ai.input.messages")
    outputs = (_messages(attrs["gen_ai.output.messages"], "gen_ai.output.messages")
               if "gen_ai.output.messages" in attrs else [])
    for event in span.get("events") or []:
        msg = _event_message(event)
        if msg is not None:
            (outputs if event.get("name") == "gen_ai.choice" else inputs).append(msg)
    inputs += _openinference(attrs, "input")
    outputs += _openinference(attrs, "output")
    if inputs or outputs or op in ("chat", "llm", "text_completion", "generate_content"):
        return "chat", inputs, outputs, tools
    return "other", [], [], tools


def _iso(ns: int) -> str | None:
    return datetime.fromtimestamp(ns / 1e9, UTC).isoformat() if ns else None


def _append_new(items: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
    """Append what `new` (a chat span's whole context) adds to the items so far."""
    same = 0
    for a, b in zip(items, new, strict=False):
        if {k: v for k, v in a.items() if k != "call_id"} != \
                {k: v for k, v in b.items() if k != "call_id"}:
            break
        same += 1
    items.extend(new[same:])


def spans_to_record(record: dict[str, Any]) -> dict[str, Any]:
    """An `otel_spans` record (one trajectory's spans, any order) → a v1-shaped dict. Raises
    `ValueError` naming the span that cannot be read."""
    spans = record[OTEL_RECORD]
    if not isinstance(spans, list) or not spans:
        raise ValueError(f"'{OTEL_RECORD}' must be a non-empty list of spans")
    parts: dict[int, tuple[str, list[Any], list[Any], list[Any]]] = {}
    for span in spans:
        try:
            _check(span)
            parts[id(span)] = _span_parts(span)
        except (ValueError, TypeError, KeyError) as err:
            sid = span.get("span_id") if isinstance(span, dict) else None
            raise ValueError(f"span {sid}: {err}") from None
    spans = sorted(spans, key=lambda s: (s["start_ns"], s["span_id"]))
    ids = {s["span_id"] for s in spans}
    roots = [s for s in spans if not s.get("parent_span_id") or s["parent_span_id"] not in ids]
    root = next((s for s in roots if parts[id(s)][0] == "agent"), roots[0])
    conv = next((c for c in map(conversation_of, spans) if c), None)
    key = trajectory_key(conv, root["trace_id"])
    items: list[dict[str, Any]] = []
    results: list[tuple[str, dict[str, Any]]] = []
    tools: dict[str, Any] = {}
    usage = {"input_tokens": 0, "output_tokens": 0}
    model = agent = None
    for s in spans:
        kind, inputs, outputs, span_tools = parts[id(s)]
        attrs = s.get("attributes") or {}
        for t in span_tools:
            fn = t.get("function", t) if isinstance(t, dict) else {}
            tools.setdefault(str(fn.get("name")), t)
        agent = agent or attrs.get("gen_ai.agent.name") or attrs.get("agent.name")
        if kind == "chat":
            _append_new(items, chat_to_items(inputs))
            items.extend(chat_to_items(outputs, first_index=len(inputs)))
            model = model or attrs.get("gen_ai.response.model") or \
                attrs.get("gen_ai.request.model") or attrs.get("llm.model_name")
            for field, keys in _USAGE.items():
                usage[field] += next((int(attrs[k]) for k in keys
                                      if isinstance(attrs.get(k), int)), 0)
        elif kind == "tool":
            results.append((s["span_id"], s))
    _merge_tool_spans(items, [s for _, s in results])
    agent = agent or (root.get("resource") or {}).get("service.name")
    end = max(s["end_ns"] for s in spans)
    out: dict[str, Any] = {
        "trajectory_id": str(trajectory_id(key)), "session_id": conv, "model": model,
        "started_at": _iso(min(s["start_ns"] for s in spans)), "ended_at": _iso(end),
        "tools": list(tools.values()), "items": items,
        "metadata": {"source_format": "otel", "request_id": conv or root["trace_id"],
                     "otel": {"key": key, "span_count": len(spans),
                              "trace_ids": sorted({s["trace_id"] for s in spans}),
                              "root_span_id": root["span_id"]}}}
    if agent:
        out["agent"] = agent
    if any(usage.values()):
        out["usage"] = usage
    if root["end_ns"]:
        out["latency_ms"] = (root["end_ns"] - root["start_ns"]) / 1e6
    outcome = outcome_of(spans, root)
    if outcome is not None:
        out["outcome"] = outcome
    return {k: v for k, v in out.items() if v is not None}


def _merge_tool_spans(items: list[dict[str, Any]], tool_spans: list[dict[str, Any]]) -> None:
    """Each tool span's result as its call's output, placed after the call, unless a chat
    span already carried it; a tool span without a logged call adds the call too."""
    answered = {i["call_id"] for i in items if i["type"] == "function_call_output"}
    for s in tool_spans:
        attrs = s.get("attributes") or {}
        call_id = attrs.get("gen_ai.tool.call.id") or attrs.get("tool_call.id") or \
            f"span_{s['span_id']}"
        if call_id in answered:
            continue
        result = attrs.get("gen_ai.tool.call.result", attrs.get("output.value"))
        error = (s.get("status") or {}).get("code") == STATUS_ERROR
        output = {"type": "function_call_output", "call_id": call_id,
                  "output": _json_or_text(result) or (s.get("status") or {}).get("message", ""),
                  "status": "error" if error else "ok"}
        at = next((n for n, i in enumerate(items) if i["type"] == "function_call"
                   and i["call_id"] == call_id), None)
        if at is None:
            name = attrs.get("gen_ai.tool.name") or attrs.get("tool.name") or s.get("name")
            args = attrs.get("gen_ai.tool.call.arguments", attrs.get("input.value"))
            items.extend([{"type": "function_call", "call_id": call_id, "name": name,
                           "arguments": _args(args)}, output])
        else:
            while at + 1 < len(items) and items[at + 1]["type"] in ("function_call",
                                                                    "function_call_output"):
                at += 1
            items.insert(at + 1, output)
        answered.add(call_id)


def outcome_of(spans: list[dict[str, Any]], root: dict[str, Any]) -> dict[str, Any] | None:
    """`flywheel.outcome.*` (the root's win over other spans'), else the root's ERROR status."""
    found: dict[str, Any] = {}
    for s in sorted(spans, key=lambda s: s is root):  # the root last: its values win
        for k, v in (s.get("attributes") or {}).items():
            if k.startswith(OUTCOME_PREFIX):
                found[k.removeprefix(OUTCOME_PREFIX)] = v
    if "feedback" in found:
        try:
            found["feedback"] = _json(found["feedback"], "flywheel.outcome.feedback")
        except ValueError:
            pass  # free text
    if "status" in found:
        return found
    status = root.get("status") or {}
    if status.get("code") == STATUS_ERROR:
        attrs = root.get("attributes") or {}
        return {"status": "error", **found,
                "error": status.get("message") or attrs.get("error.type") or "span status ERROR"}
    return None
