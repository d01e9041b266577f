"""A scripted policy for tests of the agent loop's logic: the real chat format (the SmolLM2
tokenizer and the bundled template) renders the prompts, a script writes the replies."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from flywheel.policy.base import AdapterRef, Completion, SamplingParams
from flywheel.policy.chat_format import ChatFormat


def tool_call(name: str, **arguments: Any) -> str:
    """A call as the bundled template writes it (what a trained model emits)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class Scripted:
    """Answers from a script: reply(messages, seed, index) → the reply's text, or a hang.

    Like the real engines it renders the prompt with the chat format (its ids are the
    prompt's) and records what it was sent."""

    def __init__(self, reply: Any, fmt: ChatFormat) -> None:
        self.reply, self.chat_format = reply, fmt
        self.calls = 0
        self.sent: list[tuple[list[dict[str, Any]], Any]] = []

    async def sample(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams, *,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     adapter: AdapterRef | None = None) -> list[Completion]:
        self.sent.append(([dict(m) for m in messages], tools))
        prompt = self.chat_format.render(messages, tools)
        out = []
        for i in range(params.n):
            self.calls += 1
            text = await self.reply(list(messages), params.seed, i)
            out.append(Completion(text=text, token_ids=[1, 2], logprobs=[-0.1, -0.2],
                                  prompt_token_ids=prompt, finish_reason="stop",
                                  adapter=adapter.name if adapter else None, latency_ms=1.0))
        return out

    async def ensure_adapter(self, adapter: AdapterRef) -> None: ...

    async def retire_adapter(self, adapter: AdapterRef) -> None: ...

    async def close(self) -> None: ...


class Lockstep(Scripted):
    """The same script behind `sample_many` (the local engine's batched episodes)."""

    async def sample_many(self, prompts: Sequence[Sequence[Mapping[str, Any]]],
                          params: SamplingParams, *,
                          tools: Sequence[Mapping[str, Any]] | None = None,
                          adapter: AdapterRef | None = None) -> list[list[Completion]]:
        return [await self.sample(m, params, tools=tools, adapter=adapter) for m in prompts]
