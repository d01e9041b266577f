"""Foreign log shapes → wire format v1 dicts (pure, no models): what agents already write.

Three shapes besides v1 are accepted on every path (SDK, gateway, `flywheel publish`, any
Kafka client):

* an OpenAI **Chat Completions transcript**: `messages` with `tool_calls` and `tool`
  results, `tools`, `model` (`chat_to_items`);
* a **request/response pair**, one record per model call, as proxies and SDK hooks log it and
  as the NVIDIA Data Flywheel blueprint documents it (`{timestamp, client_id, workload_id,
  request, response}`: `request` is the `chat.completions.create` body, `response` the
  ChatCompletion; see docs/FORMATS.md for the sources). `pair_to_record` appends the
  response's message to the request's transcript;
* either without an `agent`: `derive_agent` names it from the context the record came in.

What links the pairs of one episode: the record's `session_id`, else
`request.metadata.session_id` (OpenAI stored-completions metadata), else a conversation id
derived from `client_id`, `workload_id` and the conversation's opening (system prompt and
first user message), which every later call of the same conversation repeats. `workload_id`
alone never links: the blueprint defines it as a node/route type shared by many sessions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

AgentSource = Literal["record", "header", "token", "publisher", "default"]
DEFAULT_AGENT = "unknown"
AGENT_HEADER = "flywheel-agent"
"""The Kafka header a producer may name the agent in (UTF-8), for records that do not."""
PAIR_FIELDS = frozenset({"request", "response", "timestamp", "client_id", "workload_id"})
"""Top-level fields of a request/response pair that `pair_to_record` consumes."""


@dataclass(frozen=True, slots=True)
class ParseContext:
    """Where a record came from, for the fields a record may leave out (its agent)."""

    header_agent: str | None = None
    """The `flywheel-agent` Kafka header of the message."""
    token_agent: str | None = None
    """The agent configured for the gateway token that posted it."""
    publisher_agent: str | None = None
    """The publisher's default: `flywheel publish --agent`, `FlywheelClient(agent=…)`."""


def derive_agent(record_agent: object, ctx: ParseContext | None) -> tuple[object, AgentSource]:
    """The agent and where it came from: the record, the Kafka header, the gateway token,
    the publisher's default, else `"unknown"`. A record's own value is returned as is, even
    an invalid one, so validation reports it rather than hiding it behind a default."""
    if record_agent is not None:
        return record_agent, "record"
    ctx = ctx or ParseContext()
    if ctx.header_agent:
        return ctx.header_agent, "header"
    if ctx.token_agent:
        return ctx.token_agent, "token"
    if ctx.publisher_agent:
        return ctx.publisher_agent, "publisher"
    return DEFAULT_AGENT, "default"


def header_agent(headers: Iterable[tuple[str, bytes | str | None]] | None) -> str | None:
    """The `flywheel-agent` header among Kafka headers (`[(key, bytes)]`), if usable.

    A value that is not UTF-8, holds a NUL or is blank is ignored: the header is a hint, and
    the record is still accepted under the next source in the order."""
    for key, value in headers or ():
        if key != AGENT_HEADER or not isinstance(value, bytes | str):
            continue
        try:
            text = value.decode() if isinstance(value, bytes) else value
            text.encode()  # a str header may hold lone surrogates: no name at all
        except UnicodeError:
            return None
        return None if "\x00" in text else text.strip() or None
    return None


def is_chat_transcript(record: dict[str, Any]) -> bool:
    return "messages" in record and "items" not in record


def is_pair(record: dict[str, Any]) -> bool:
    return "request" in record and "response" in record and "items" not in record


def chat_to_items(messages: list[Any], *, first_index: int = 0) -> list[dict[str, Any]]:
    """OpenAI Chat Completions `messages` (with `tool_calls`) → v1 items, order kept.

    A tool call without an `id` (the Data Flywheel sample data has none) gets
    `call_<message index>_<call index>`; `first_index` is the index of `messages[0]` in the
    whole conversation, so a response appended to its request numbers its calls as the next
    request of the conversation will."""
    items: list[dict[str, Any]] = []
    for i, msg in enumerate(messages, start=first_index):
        if not isinstance(msg, dict) or "role" not in msg:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
        role = msg["role"]
        extra = {k: v for k, v in msg.items() if k not in {"role", "content", "tool_calls",
                                                            "tool_call_id", "status"}}
        if role == "tool":
            if "tool_call_id" not in msg:
                raise ValueError(f"messages[{i}] (role 'tool') needs 'tool_call_id'")
            content = msg.get("content")
            output = content if isinstance(content, str) else json.dumps(content)
            items.append({"type": "function_call_output", "call_id": msg["tool_call_id"],
                          "output": output, "status": msg.get("status", "ok"), **extra})
            continue
        calls = msg.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls must be a list of tool calls, got "
                             f"{type(calls).__name__}")
        if msg.get("content") not in (None, "", []) or not calls:
            items.append({"type": "message", "role": role, "content": msg.get("content"),
                          **extra})
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or "name" not in fn:
                raise ValueError(f"messages[{i}].tool_calls[{j}] needs function.name")
            args = fn.get("arguments", "")
            items.append({"type": "function_call", "call_id": call.get("id") or f"call_{i}_{j}",
                          "name": fn["name"],
                          "arguments": args if isinstance(args, str) else json.dumps(args)})
    return items


def conversation_id(client_id: object, workload_id: object, messages: list[Any]) -> str:
    """`conv-<hash>` of the deployment, the node and the conversation's opening.

    The opening is every message up to and including the first user message: each later
    call of the conversation sends it again, so all of them get the same id."""
    opening: list[Any] = []
    for msg in messages:
        if isinstance(msg, dict):
            opening.append([msg.get("role"), msg.get("content")])
            if msg.get("role") == "user":
                break
    canonical = json.dumps({"client_id": client_id, "workload_id": workload_id,
                            "opening": opening}, sort_keys=True, separators=(",", ":"),
                           default=str)
    return "conv-" + hashlib.sha256(canonical.encode()).hexdigest()[:24]


def _pair_parts(record: dict[str, Any]) -> tuple[dict[str, Any], list[Any], dict[str, Any],
                                                 dict[str, Any]]:
    """(request, its messages, response, the chosen choice), with the blueprint validator's
    checks as readable errors."""
    req, resp = record["request"], record["response"]
    if not isinstance(req, dict):
        raise ValueError("'request' must be an object: the chat.completions.create body")
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("request.messages must be a non-empty list of chat messages")
    if not isinstance(resp, dict):
        raise ValueError("'response' must be an object: the ChatCompletion the call returned")
    choices = resp.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ValueError("response.choices must be a non-empty list")
    choice = choices[0]
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise ValueError("response.choices[0] must be an object with a 'message'")
    return req, messages, resp, choice


def pair_to_record(record: dict[str, Any]) -> dict[str, Any]:
    """A request/response pair → a v1-shaped dict (items, tools, model, usage, started_at,
    session_id, metadata); fields of ours the pair carries (`agent`, `outcome`, …) are kept.

    The first choice is the call's answer; others are kept in `metadata.response`.
    `metadata.response_index` is where the answer's items begin: what comes before is the
    request's context (earlier calls of the conversation), judged when those were. What the
    request and response hold besides messages, tools, choices and usage is kept under
    `metadata.request` / `metadata.response`: nothing is dropped."""
    req, messages, resp, choice = _pair_parts(record)
    answer = {"role": "assistant", **choice["message"]}
    out = {k: v for k, v in record.items() if k not in PAIR_FIELDS}
    history = chat_to_items(messages)
    out["items"] = history + chat_to_items([answer], first_index=len(messages))
    if "tools" in req and "tools" not in out:
        out["tools"] = req["tools"]
    model = resp.get("model") or req.get("model")
    if model is not None and out.get("model") is None:
        out["model"] = model
    usage = resp.get("usage")
    if isinstance(usage, dict) and out.get("usage") is None:
        rest = {k: v for k, v in usage.items() if k not in ("prompt_tokens", "completion_tokens")}
        out["usage"] = {"input_tokens": usage.get("prompt_tokens"),
                        "output_tokens": usage.get("completion_tokens"), **rest}
    if record.get("timestamp") is not None and out.get("started_at") is None:
        # The blueprint's README: "`int` (epoch secs) | Time the request was issued".
        out["started_at"] = record["timestamp"]
    req_meta = req.get("metadata")
    session_source = "record"
    if out.get("session_id") is None:
        if isinstance(req_meta, dict) and isinstance(req_meta.get("session_id"), str):
            out["session_id"], session_source = req_meta["session_id"], "request.metadata"
        else:
            out["session_id"] = conversation_id(record.get("client_id"),
                                                record.get("workload_id"), messages)
            session_source = "conversation"
    response_meta = {k: v for k, v in resp.items() if k not in ("choices", "usage")}
    response_meta["choice"] = {k: v for k, v in choice.items() if k != "message"}
    if len(resp["choices"]) > 1:
        response_meta["other_choices"] = resp["choices"][1:]
    meta = out.get("metadata", {})
    if not isinstance(meta, dict):
        return out  # validation says that metadata must be an object
    added: dict[str, Any] = {
        "source_format": "request_response", "session_source": session_source,
        "response_index": len(history),
        "request": {k: v for k, v in req.items() if k not in ("messages", "tools")},
        "response": response_meta}
    for key in ("client_id", "workload_id"):
        if record.get(key) is not None:
            added[key] = record[key]
    if isinstance(resp.get("id"), str) and out.get("request_id") is None \
            and "request_id" not in meta:
        added["request_id"] = resp["id"]
    out["metadata"] = {**meta, **added}
    return out
