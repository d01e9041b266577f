"""OpenAI Responses API logs → wire format v1 dicts (pure, no models).

What an agent on the Responses API (`client.responses.create`, the OpenAI Agents SDK's
default) can log, in three shapes, each detected by `is_responses_log`:

* a **`response` object** (`"object": "response"`) as the API returns it, with the `input`
  the agent sent attached (a string or input items). Every field but ours (`agent`,
  `outcome`, `session_id`, `trajectory_id`, `adapter_version`, `latency_ms`) is the
  response's own, `metadata` included (OpenAI's string tags);
* a **request/response pair** whose `response` is a `response` object and whose `request`
  is the `responses.create` body (`input`, `instructions`, `tools`, …);
* a **chain**, `{"responses": [...]}` of either: the calls of one conversation, stitched
  through `previous_response_id` into one trajectory whatever the order they are listed in
  (each call's `input` then holds only what it adds: tool results, the next user turn).

A call's items are its `instructions` (a system message, again whenever they change along
the chain), its input items, then its `output` items: `message`s (text parts joined),
`function_call`s and `function_call_output`s (Responses' `completed` → `ok`, `incomplete` →
`error`) and `reasoning`. What v1 has no item for (built-in tool calls such as
`web_search_call`, non-function tools) is kept in `metadata`, never dropped.
"""

from __future__ import annotations

import json
from typing import Any

OURS = frozenset({"agent", "outcome", "session_id", "trajectory_id", "adapter_version",
                  "latency_ms"})
"""Fields of ours a logged `response` object may carry beside its own."""
_CONVERTED = frozenset({"input", "output", "instructions", "tools", "usage"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
_CALL_STATUS = {None: "ok", "completed": "ok", "in_progress": "ok", "incomplete": "error"}


def _is_response(value: object) -> bool:
    return isinstance(value, dict) and value.get("object") == "response"


def is_responses_log(record: dict[str, Any]) -> bool:
    if "items" in record:
        return False
    chain = record.get("responses")
    return _is_response(record) or _is_response(record.get("response")) or (
        isinstance(chain, list) and "messages" not in record)


def _turn(value: object, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(request, response) of one logged call."""
    if _is_response(value):
        assert isinstance(value, dict)
        resp = {k: v for k, v in value.items() if k not in OURS}
        return {"input": resp.pop("input", None)}, resp
    if isinstance(value, dict) and _is_response(value.get("response")):
        req = value.get("request", {})
        if not isinstance(req, dict):
            raise ValueError(f"{where}.request must be an object: the responses.create body")
        return req, value["response"]
    raise ValueError(f"{where} must be a Responses API `response` object (\"object\": "
                     "\"response\") or {\"request\": …, \"response\": <response object>}")


def _chain(turns: list[tuple[dict[str, Any], dict[str, Any]]]
           ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The calls in conversation order, following `previous_response_id`."""
    by_id: dict[str, int] = {}
    for i, (_, resp) in enumerate(turns):
        rid = resp.get("id")
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"responses[{i}].id must be the response's id (a string): a "
                             "chain is stitched by it")
        if rid in by_id:
            raise ValueError(f"responses[{by_id[rid]}] and responses[{i}] are both {rid!r}")
        by_id[rid] = i
    nxt: dict[str | None, int] = {}
    for i, (req, resp) in enumerate(turns):
        prev = resp.get("previous_response_id") or req.get("previous_response_id")
        key = prev if prev in by_id else None
        if key in nxt:
            what = f"continue {key!r}" if key else "start the chain (no previous response " \
                                                    "among the listed ones)"
            raise ValueError(f"responses[{nxt[key]}] and responses[{i}] both {what}: a "
                             "trajectory is one linear chain; send each branch as a record")
        nxt[key] = i
    order, at = [], nxt.get(None)
    while at is not None:
        order.append(at)
        at = nxt.get(turns[at][1]["id"])
    if len(order) != len(turns):
        raise ValueError("responses: the previous_response_id links form a loop")
    return [turns[i] for i in order]


def _text(content: object) -> object:
    """Text parts as one string (joined by a newline); anything else as sent."""
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") in _TEXT_PARTS
            and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return content


def to_items(raw: object, where: str, other: list[dict[str, Any]],
             start: int) -> list[dict[str, Any]]:
    """Responses input or output items → v1 items; what v1 cannot hold goes to `other`
    with the index it had among the items."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise ValueError(f"{where} must be a string or a list of items, got "
                         f"{type(raw).__name__}")
    items: list[dict[str, Any]] = []
    for j, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ValueError(f"{where}[{j}] must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        rest = {k: v for k, v in item.items() if k not in ("type", "content", "output",
                                                           "status")}
        if kind == "message":
            if "role" not in item:
                raise ValueError(f"{where}[{j}] (a message) needs a 'role'")
            items.append({"type": "message", **rest, "content": _text(item.get("content"))})
        elif kind == "function_call":
            items.append({**item, "arguments": _arguments(item.get("arguments", ""))})
        elif kind == "function_call_output":
            out = _text(item.get("output"))
            status = _CALL_STATUS.get(item.get("status"), item.get("status"))
            items.append({"type": kind, **rest, "status": status,
                          "output": out if isinstance(out, str) else json.dumps(out)})
        elif kind == "reasoning":
            content = item.get("content") or item.get("summary")
            items.append({"type": kind, **{k: v for k, v in item.items() if k != "content"},
                          "content": _text(content)})
        else:
            other.append({"index": start + len(items), "item": item})
    return items


def _arguments(args: object) -> object:
    return args if isinstance(args, str) else json.dumps(args)


def _tools(turns: list[tuple[dict[str, Any], dict[str, Any]]],
           other: list[dict[str, Any]]) -> list[Any]:
    """Every function tool offered along the chain (a later definition of a name wins)."""
    tools: dict[str, Any] = {}
    for req, resp in turns:
        offered = resp.get("tools") if resp.get("tools") is not None else req.get("tools")
        for tool in offered or ():
            if isinstance(tool, dict) and tool.get("type", "function") == "function":
                fn = tool.get("function", tool)
                tools[str(fn.get("name") if isinstance(fn, dict) else fn)] = tool
            elif tool not in other:
                other.append(tool)
    return list(tools.values())


def responses_to_record(record: dict[str, Any]) -> dict[str, Any]:
    """A Responses API log (one call, a pair or a chain) → a v1-shaped dict."""
    if isinstance(record.get("responses"), list):
        if not record["responses"]:
            raise ValueError("responses must list at least one response")
        turns = _chain([_turn(r, f"responses[{i}]") for i, r in enumerate(record["responses"])])
        out = {k: v for k, v in record.items() if k != "responses"}
    elif _is_response(record):
        turns = [_turn(record, "the record")]
        out = {k: v for k, v in record.items() if k in OURS}
    else:
        turns = [_turn(record, "the record")]
        out = {k: v for k, v in record.items() if k not in ("request", "response")}
    other_items: list[dict[str, Any]] = []
    other_tools: list[Any] = []
    items: list[dict[str, Any]] = []
    instructions: object = None
    for i, (req, resp) in enumerate(turns):
        said = resp.get("instructions") or req.get("instructions")
        if said and said != instructions:
            items.append({"type": "message", "role": "system", "content": _text(said)})
        instructions = said or instructions
        items += to_items(req.get("input"), f"responses[{i}].input", other_items, len(items))
        items += to_items(resp.get("output"), f"responses[{i}].output", other_items,
                          len(items))
    out["items"] = items
    tools = _tools(turns, other_tools)
    if tools and "tools" not in out:
        out["tools"] = tools
    first, last = turns[0][1], turns[-1][1]
    for ours, theirs in (("model", last.get("model")), ("started_at", first.get("created_at")),
                         ("ended_at", last.get("completed_at"))):
        if theirs is not None and out.get(ours) is None:
            out[ours] = theirs
    usages = [r["usage"] for _, r in turns if isinstance(r.get("usage"), dict)]
    if usages and out.get("usage") is None:
        out["usage"] = {k: sum(u.get(k) or 0 for u in usages)
                        for k in ("input_tokens", "output_tokens", "total_tokens")}
    if out.get("outcome") is None and last.get("status") == "failed":
        error = last.get("error")
        out["outcome"] = {"status": "error", "error": error.get("message") if isinstance(
            error, dict) else str(error or "the response failed")}
    if out.get("session_id") is None:
        out["session_id"] = _session(turns)
    meta = out.get("metadata", {})
    if not isinstance(meta, dict):
        return out  # validation says that metadata must be an object
    added: dict[str, Any] = {
        "source_format": "responses", "response_ids": [r["id"] for _, r in turns
                                                       if "id" in r],
        "responses": [{**{k: v for k, v in req.items() if k not in _CONVERTED},
                       **{k: v for k, v in resp.items() if k not in _CONVERTED}}
                      for req, resp in turns]}
    if other_items:
        added["other_items"] = other_items
    if other_tools:
        added["other_tools"] = other_tools
    if isinstance(last.get("id"), str) and "request_id" not in meta \
            and out.get("request_id") is None:
        added["request_id"] = last["id"]
    out["metadata"] = {**meta, **added}
    return out


def _session(turns: list[tuple[dict[str, Any], dict[str, Any]]]) -> str | None:
    """`metadata.session_id` (either side), else the Responses conversation's id, else the
    id of the record's first response."""
    req, resp = turns[0]
    for meta in (resp.get("metadata"), req.get("metadata")):
        if isinstance(meta, dict) and isinstance(meta.get("session_id"), str):
            return str(meta["session_id"])
    conv = resp.get("conversation") or req.get("conversation")
    if isinstance(conv, dict) and isinstance(conv.get("id"), str):
        return str(conv["id"])
    if isinstance(conv, str):
        return conv
    first = resp.get("id")
    return first if isinstance(first, str) else None
