"""The policy interface every engine implements, and the types it speaks.

A policy turns chat messages and the tools offered into G sampled completions, each stamped
with the adapter version that produced it and carrying the sampled token ids and their
sampling log-probs (log-softmax of the logits divided by the temperature, at the sampled
token), so the trainer never re-tokenizes text. Every engine renders the prompt and parses
the reply with the policy's one chat format (`chat_format.py`), as serving does. Adapter
versions are immutable: version N is served under the name `<policy>@v<N>` and never
reloaded under the same name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from flywheel.policy.chat_format import ChatFormat


def served_name(policy: str, version: int) -> str:
    """The immutable serving name of an adapter version."""
    return f"{policy}@v{version}"


@dataclass(frozen=True)
class AdapterRef:
    """An adapter version to sample from; `None` in calls means the base model."""

    policy: str
    version: int
    path: Path
    """Directory holding the PEFT adapter (adapter_config.json + weights)."""

    @property
    def name(self) -> str:
        return served_name(self.policy, self.version)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 8
    """Group size G: completions per prompt."""
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    """Generation stops after any of these strings (kept in the text). Rollouts use none: the
    end-of-turn token ends a reply, as in serving."""
    prefill: str = ""
    """Text the assistant turn starts with, rendered right after the generation prompt: part
    of the prompt (and of `prompt_token_ids`), not of the completion. Only serving uses one,
    for `tool_choice` "required" or a named function (`flywheel.policy.tool_choice`); rollouts
    and the gate never do."""
    grammar: str | None = None
    """A grammar the completion (what follows the prefill) must match, in llguidance's Lark
    dialect; it ends the turn where the grammar ends (`flywheel.policy.call_grammar`). Only
    serving's `tool_choice` "required" or a named function sets one; rollouts and the gate
    sample unconstrained. The local engine masks the logits of these rows only, and their
    `logprobs` are those of the masked distribution sampled from; vLLM applies it as a
    structured output."""


@dataclass(frozen=True)
class Completion:
    text: str
    """The generated text (special tokens such as the end-of-turn token left out)."""
    token_ids: list[int]
    logprobs: list[float]
    """Sampling log-prob of each generated token (same length as `token_ids`). Both engines
    agree (and match the trainer) at top_p = 1, which rollouts use; with top_p < 1 vLLM
    reports the log-prob under the renormalised nucleus, the local engine without it."""
    prompt_token_ids: list[int]
    finish_reason: str
    """"stop" (a stop condition or EOS) or "length"."""
    adapter: str | None
    """Served name of the adapter used (`<policy>@v<N>`), None for the base model."""
    latency_ms: float
    extra: dict[str, Any] = field(default_factory=dict)


class PolicyError(RuntimeError):
    """The engine could not sample (after its own retries)."""


class AdapterNotServed(PolicyError):
    """No replica serves the adapter asked for any more (another process's retention
    unloaded it from the shared replicas, or a replica restarted): `ensure_adapter` places
    it again."""


@runtime_checkable
class Policy(Protocol):
    """What rollout workers, the gate and the benchmarks call."""

    @property
    def chat_format(self) -> ChatFormat:
        """How prompts are rendered and replies parsed (the same for every engine)."""
        ...

    async def sample(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams, *,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     adapter: AdapterRef | None = None) -> list[Completion]:
        """`params.n` completions for one chat prompt, rendered by `chat_format` with `tools`
        (OpenAI or Flywheel's flat shape); parse each `text` with `chat_format.parse`."""
        ...

    async def ensure_adapter(self, adapter: AdapterRef) -> None:
        """Make `adapter` servable (load it everywhere it must be; verify); idempotent."""
        ...

    async def retire_adapter(self, adapter: AdapterRef) -> None:
        """Stop serving a version (retention); never for production or baseline."""
        ...

    async def close(self) -> None: ...
