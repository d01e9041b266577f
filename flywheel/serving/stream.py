"""`stream: true`: a finished chat completion as the server-sent events OpenAI sends.

The engines generate whole completions (the local engine runs `generate` to the end; the
vLLM engine asks vLLM for a whole completion, because Flywheel parses the reply itself), so
a streamed answer is cut into chunks after generation: the first event comes when the
whole answer is ready. What the stream assembles is therefore exactly the non-streamed
answer of the same request. The chunks have OpenAI's shape: per choice a `delta.role` chunk,
`delta.content` fragments, for each call a chunk with its `index`, `id`, `type` and
`function.name` (arguments `""`) followed by `function.arguments` fragments, and an empty
delta with the `finish_reason`; with `stream_options.include_usage` every chunk carries
`usage: null` and a last chunk with no choices carries the usage; then `data: [DONE]`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

_PIECE = re.compile(r"\S+\s*|\s+")


def pieces(text: str) -> list[str]:
    """`text` cut into word-sized fragments (a word and the whitespace after it)."""
    return _PIECE.findall(text)


def chunks(response: dict[str, Any], *, include_usage: bool) -> Iterator[dict[str, Any]]:
    """The `chat.completion.chunk` objects of a finished `chat.completion`."""
    head = {"id": response["id"], "object": "chat.completion.chunk",
            "created": response["created"], "model": response["model"],
            "system_fingerprint": response.get("system_fingerprint")}
    first = True

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None,
              **extra: Any) -> dict[str, Any]:
        nonlocal first
        out = {**head, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                    "finish_reason": finish, **extra}]}
        if first and "prompt_token_ids" in response:
            out["prompt_token_ids"] = response["prompt_token_ids"]  # vLLM: in the first chunk
        first = False
        if include_usage:
            out["usage"] = None
        return out

    for choice in response["choices"]:
        index, message = choice["index"], choice["message"]
        content = message.get("content")
        yield chunk(index, {"role": "assistant", "content": "" if content is not None else None})
        for piece in pieces(content or ""):
            yield chunk(index, {"content": piece})
        for k, call in enumerate(message.get("tool_calls") or ()):
            yield chunk(index, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                                "function": {"name": call["function"]["name"],
                                                             "arguments": ""}}]})
            for piece in pieces(call["function"]["arguments"]):
                yield chunk(index, {"tool_calls": [{"index": k,
                                                    "function": {"arguments": piece}}]})
        extra = {"token_ids": choice["token_ids"]} if "token_ids" in choice else {}
        yield chunk(index, {}, choice["finish_reason"], **extra)
    if include_usage:
        yield {**head, "choices": [], "usage": response["usage"]}


def events(response: dict[str, Any], *, include_usage: bool) -> Iterator[str]:
    """The `text/event-stream` body: one `data:` event per chunk, then `data: [DONE]`."""
    for c in chunks(response, include_usage=include_usage):
        yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
