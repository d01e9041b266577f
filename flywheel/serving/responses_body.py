"""A chat completion as a Responses API `response` object, and as its event stream.

The answer's text is one `message` output item (`output_text` part) and each tool call a
`function_call` item (its `call_id` is the chat answer's call id); a reply cut by
`max_output_tokens` is `incomplete` (`incomplete_details.reason: max_output_tokens`), as
OpenAI reports it. `stream: true` sends the events OpenAI sends, cut from the finished
answer (as `serving.stream` does for chat: the engines generate whole completions), so what a
stream assembles is exactly the non-streamed `response`: `response.created`,
`response.in_progress`, per item `response.output_item.added`, then for a message
`response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
`response.content_part.done`, for a call `response.function_call_arguments.delta`…,
`response.function_call_arguments.done`, then `response.output_item.done`, and last
`response.completed` (or `response.incomplete`) with the whole response.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from flywheel.serving.responses_request import ResponsesRequest
from flywheel.serving.stream import pieces


def response_body(request: ResponsesRequest, completion: dict[str, Any],
                  response_id: str) -> dict[str, Any]:
    """The `response` object of `completion` (a one-choice `chat.completion`)."""
    (choice,) = completion["choices"]
    message = choice["message"]
    cut = choice["finish_reason"] == "length"
    status = "incomplete" if cut else "completed"
    suffix = response_id.removeprefix("resp_")
    output: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append({"type": "message", "id": f"msg_{suffix}", "role": "assistant",
                       "status": status, "content": [
                           {"type": "output_text", "text": message.get("content") or "",
                            "annotations": [], "logprobs": []}]})
    for k, call in enumerate(calls):
        output.append({"type": "function_call", "id": f"fc_{suffix}_{k}",
                       "call_id": call["id"], "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    usage = completion["usage"]
    body: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": completion["created"],
        "status": status, "completed_at": int(time.time()), "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "model": completion["model"], "output": output,
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "tool_choice": request.echo_tool_choice(), "tools": request.echo_tools(),
        "store": request.store, "metadata": request.metadata or {},
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "user": request.user,
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens": usage["completion_tokens"],
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]}}
    if "prompt_token_ids" in completion:
        body["prompt_token_ids"] = completion["prompt_token_ids"]
    return body


def assistant_message(body: dict[str, Any]) -> dict[str, Any]:
    """The answer as the Chat Completions assistant message a chained call continues."""
    text = "".join(p["text"] for item in body["output"] if item["type"] == "message"
                   for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in body["output"] if i["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    elif not text:
        message["content"] = ""
    return message


def stream_events(body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The events of a finished `response`, numbered by `sequence_number`."""
    seq = 0

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **fields}

    shell = {**body, "status": "in_progress", "output": [], "usage": None,
             "completed_at": None, "incomplete_details": None}
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    for i, item in enumerate(body["output"]):
        where = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=i,
                        item={**item, "status": "in_progress", "content": []})
            for c, part in enumerate(item["content"]):
                yield event("response.content_part.added", **where, content_index=c,
                            part={**part, "text": ""})
                for piece in pieces(part["text"]):
                    yield event("response.output_text.delta", **where, content_index=c,
                                delta=piece, logprobs=[])
                yield event("response.output_text.done", **where, content_index=c,
                            text=part["text"], logprobs=[])
                yield event("response.content_part.done", **where, content_index=c,
                            part=part)
        else:
            yield event("response.output_item.added", output_index=i,
                        item={**item, "arguments": "", "status": "in_progress"})
            for piece in pieces(item["arguments"]):
                yield event("response.function_call_arguments.delta", **where, delta=piece)
            yield event("response.function_call_arguments.done", **where, name=item["name"],
                        arguments=item["arguments"])
        yield event("response.output_item.done", output_index=i, item=item)
    last = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
    yield event(last, response=body)


def sse(body: dict[str, Any]) -> Iterator[str]:
    """The `text/event-stream` body: `event: <type>` and `data: <json>` per event."""
    for e in stream_events(body):
        yield f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n"
