"""`POST /v1/chat/completions` and `GET /v1/models` behind the routes: one request through the
policy's chat format and engine, and the answer in OpenAI's shape.

A request is rendered with its `tools` by the policy's `ChatFormat` and sampled by the same
`Policy.sample` rollouts and the gate call (local engine or vLLM), then each completion is
parsed by the same `ChatFormat.parse`; `tool_choice` adds only what `policy.tool_choice` says.
Without a prefill or stop of its own (`tool_choice: auto`, the default, with parallel calls
allowed) a request is decoded exactly as the gate decodes a holdout task.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from flywheel.adapters import queries
from flywheel.policy.base import AdapterNotServed, Completion, SamplingParams
from flywheel.policy.chat_format import ChatFormat
from flywheel.policy.tool_choice import Decoding, answer, decoding
from flywheel.serving.request import ChatRequest
from flywheel.serving.sync import ServingSync, Target

DEFAULT_MAX_TOKENS = 256
"""Completion length when a request sets neither `max_tokens` nor `max_completion_tokens`."""


async def complete(serving: ServingSync, request: ChatRequest) -> dict[str, Any]:
    """The `chat.completion` answer to `request` from the version its `model` names."""
    target = await serving.resolve(request.model)
    policy = await serving.loaded_policy()
    # A thread: the vLLM engine loads the tokenizer it parses with on first use.
    fmt = await asyncio.to_thread(lambda: policy.chat_format)
    messages, tools = request.template_messages(), request.template_tools()
    # A thread: reading the call markup off the template renders and tokenizes.
    d = await asyncio.to_thread(decoding, fmt, messages, tools, request.choice(),
                                request.parallel_tool_calls)
    params = SamplingParams(
        n=request.n, seed=request.seed,
        max_tokens=request.max_completion_tokens or request.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        stop=d.stop + request.stops(), prefill=d.prefill, grammar=d.grammar)
    started = time.time()
    out = await sample_placed(serving, target, messages, params, d.tools)
    return completion_body(request, target.name, fmt, d, out, started)


async def sample_placed(serving: ServingSync, target: Target,
                        messages: Sequence[Mapping[str, Any]], params: SamplingParams,
                        tools: Sequence[Mapping[str, Any]] | None) -> list[Completion]:
    """`Policy.sample` of `target`; when no replica serves its adapter any more (a replica
    restarted, or retention elsewhere dropped it), place it again and answer anyway."""
    policy = await serving.loaded_policy()
    try:
        return await policy.sample(messages, params, tools=tools, adapter=target.adapter)
    except AdapterNotServed:
        await serving.place_again(target)
        return await policy.sample(messages, params, tools=tools, adapter=target.adapter)


def completion_body(request: ChatRequest, model: str, fmt: ChatFormat, d: Decoding,
                    completions: list[Completion], started: float) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(completions):
        message, finish = answer(fmt, d, c.text, c.finish_reason, request.stops(),
                                 id_prefix=call_id_prefix(request, i))
        choice: dict[str, Any] = {"index": i, "message": message, "logprobs": None,
                                  "finish_reason": finish}
        if request.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    prompt_tokens = len(completions[0].prompt_token_ids) if completions else 0
    generated = sum(len(c.token_ids) for c in completions)
    body: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
        "created": int(started), "model": model, "system_fingerprint": fmt.version,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                  "total_tokens": prompt_tokens + generated}}
    if request.return_token_ids and completions:
        body["prompt_token_ids"] = list(completions[0].prompt_token_ids)
    return body


def call_id_prefix(request: ChatRequest, index: int) -> str:
    """Call ids that are unique across a conversation's turns (each turn's history differs)
    and identical for an identical request, streamed or not."""
    digest = hashlib.sha256(request.model_dump_json(
        include={"model", "messages", "tools", "tool_choice", "seed", "n"}).encode()
        + f"#{index}".encode()).hexdigest()[:16]
    return f"call_{digest}_"


async def model_cards(serving: ServingSync) -> list[dict[str, Any]]:
    """`production`, `base` and every registered version whose artifact is in the store."""
    async with serving.engine.connect() as conn:
        pointer = await queries.production(conn, serving.name)
        versions = await queries.list_adapters(conn, serving.name)
    stored = set(await asyncio.to_thread(serving.adapters.store.versions, serving.name))
    now = int(time.time())
    if serving.current is not None:
        alias_of = serving.current.name
    elif pointer.get("version") is not None:
        alias_of = f"{serving.name}@v{pointer['version']}"
    else:
        alias_of = "base"
    cards = [_card("production", now, alias_of=alias_of), _card("base", now)]
    for v in versions:
        if v["version"] in stored:
            cards.append(_card(f"{serving.name}@v{v['version']}", _epoch(v.get("created_at"), now),
                               status=v["status"], stage=v["stage"],
                               parent=_parent(serving.name, v.get("parent_version"))))
    return cards


def _parent(policy: str, parent_version: object) -> str:
    """The version a version was trained from, named as `/v1/models` names it (`base` for
    none or 0: trained from the base model)."""
    return f"{policy}@v{parent_version}" if isinstance(parent_version, int) and parent_version \
        else "base"


def _card(name: str, created: int, **extra: Any) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "flywheel", **extra}


def _epoch(value: object, default: int) -> int:
    try:
        return int(datetime.fromisoformat(str(value)).timestamp())
    except ValueError:
        return default
