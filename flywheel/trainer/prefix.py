"""Log-probs of many completions of one prompt, with the prompt run once (shared prefix).

A GRPO group is G completions of the same prompt: a long one (instructions, tools, request)
with short completions. Running prompt + completion G times wastes most of the compute, so
the prompt runs once, its keys/values are cut out of the graph as leaf tensors, every
completion runs on top of them (expanded, never copied per row), and once all of them have
back-propagated into the leaves, `backward_prompt` pushes the summed gradient through the
prompt pass in one go. LoRA on q/k/v/o changes the prompt's keys and values, so this is the
exact gradient, not an approximation. The first completion token is predicted by the prompt's
last position, so that logit is kept (and cut) the same way.

The same cut works one level up: the prompts of a batch mostly share their instructions and
tool list, so that common prefix can run once too, each prompt continuing it (`parent`).
Only full-attention decoders (Llama, SmolLM2): a sliding-window layer would need its window
applied across the cut. The cache helpers are `flywheel.policy.kv`'s, which the local engine
samples with too.

Import this module lazily: it imports torch and transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from flywheel.policy.kv import cache_kwarg, cache_tensors, kv_cache
from flywheel.policy.logprobs import token_logprobs


@dataclass
class EncodedPrompt:
    """One prompt's forward pass, cut at its keys/values and last logits."""

    length: int
    leaves: list[Tensor]
    """Per layer keys, values [1, H_kv, P, D], then the last position's logits [1, V]. Leaves:
    completions back-propagate into their `.grad` (when encoded with grad)."""
    graph: list[Tensor]
    """The same tensors still attached to the prompt pass (empty when encoded without grad)."""

    @property
    def last_logits(self) -> Tensor:
        return self.leaves[-1]

    @property
    def kv(self) -> list[Tensor]:
        return self.leaves[:-1]


def encode_prompt(model: Any, prompt_ids: Sequence[int],
                  parent: EncodedPrompt | None = None) -> EncodedPrompt:
    """Run `prompt_ids` once (with grad if grad is enabled) and cut the result into leaves.

    With `parent`, `prompt_ids` continue it (the prompt is parent + prompt_ids), and
    `backward_prompt` of the result leaves its gradient on the parent's leaves.
    """
    device = next(model.parameters()).device
    start = 0 if parent is None else parent.length
    cache = DynamicCache() if parent is None else kv_cache(parent.kv, 1)
    positions = torch.arange(start, start + len(prompt_ids), device=device)[None]
    out = model(input_ids=torch.tensor([list(prompt_ids)], device=device),
                position_ids=positions, use_cache=True, logits_to_keep=1,
                **{cache_kwarg(model): cache})
    tensors = [*cache_tensors(cache), out.logits[:, -1]]
    length = start + len(prompt_ids)
    if not torch.is_grad_enabled():
        return EncodedPrompt(length, tensors, [])
    return EncodedPrompt(length, [t.detach().requires_grad_() for t in tensors], tensors)


def shared_prefix_len(prompts: Sequence[Sequence[int]], minimum: int = 16) -> int:
    """Tokens that ≥ 2 prompts all start with, short of the shortest one's last (so each has a
    token of its own); 0 when fewer than `minimum` (not worth a pass of their own)."""
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != prompts[0][i]), n)
    return n if n >= minimum else 0


def completion_logps(model: Any, prompt: EncodedPrompt, completions: Sequence[Sequence[int]],
                     pad_id: int, temperature: float) -> Tensor:
    """Log-probs of each completion's tokens after `prompt`, right-padded: [n, K].

    K is the longest completion; columns past a completion's end hold finite junk for the
    caller to mask. One forward of [n, K − 1] tokens on a fresh cache built from the prompt's
    leaves, so the leaves are never mutated and can serve any number of calls.
    """
    return completion_scores(model, prompt, completions, pad_id, temperature)[0]


def completion_scores(model: Any, prompt: EncodedPrompt, completions: Sequence[Sequence[int]],
                      pad_id: int, temperature: float, *, hits: bool = False,
                      columns: Sequence[int] | None = None) -> tuple[Tensor, Tensor | None]:
    """`completion_logps`, and with `hits` whether each token is the argmax: [n, K] bool.

    `columns` (sorted, distinct, each < K): only those columns are scored, [n, len(columns)]
    — the vocabulary projection runs at those positions alone. SFT on a multi-turn
    demonstration scores the reply's few tokens after hundreds of conversation tokens; the
    logits of every position ([K, V] fp32 a row, several copies for the backward) would
    cost more memory than the layers' activations."""
    device = prompt.last_logits.device
    n, k = len(completions), max(len(c) for c in completions)
    ids = torch.full((n, k), pad_id, dtype=torch.long, device=device)            # [n, K]
    for i, c in enumerate(completions):
        ids[i, :len(c)] = torch.tensor(list(c), device=device)
    cols = list(range(k)) if columns is None else list(columns)
    later = [c for c in cols if c >= 1]
    parts: list[Tensor] = []
    hit_parts: list[Tensor] = []
    if cols and cols[0] == 0:
        last = prompt.last_logits[:, None].expand(n, 1, -1)                      # [n, 1, V]
        parts.append(token_logprobs(last, ids[:, :1], temperature))             # [n, 1]
        if hits:
            hit_parts.append(last.argmax(-1) == ids[:, :1])
    if later:
        # Right padding sits after every real token, so plain causal attention never lets a
        # real token see it; positions continue from the prompt's. Column c is predicted at
        # input position c − 1; the forward stops at the last column asked for.
        width = later[-1]
        positions = torch.arange(prompt.length, prompt.length + width, device=device)
        keep: int | Tensor = (width if columns is None
                              else torch.tensor([c - 1 for c in later], device=device))
        logits = model(input_ids=ids[:, :width], position_ids=positions[None].expand(n, -1),
                       use_cache=True, logits_to_keep=keep,
                       **{cache_kwarg(model): kv_cache(prompt.kv, n)}).logits   # [n, C, V]
        target = ids[:, later]
        parts.append(token_logprobs(logits, target, temperature))
        if hits:
            hit_parts.append(logits.argmax(-1) == target)
    logp = torch.cat(parts, dim=1) if parts else ids.new_zeros((n, 0), dtype=torch.float32)
    hit = (torch.cat(hit_parts, dim=1) if hit_parts else None) if hits else None
    return logp, hit


def backward_prompt(prompt: EncodedPrompt) -> None:
    """Back-propagate what the completions left on the leaves through the prompt pass."""
    pairs = [(t, leaf.grad) for t, leaf in zip(prompt.graph, prompt.leaves, strict=True)
             if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    prompt.leaves.clear()
    prompt.graph.clear()


def by_prompt(prompts: Sequence[tuple[Sequence[int], float]]) -> list[list[int]]:
    """Indices of equal (prompt ids, temperature) keys, in order of first appearance."""
    out: dict[tuple[tuple[int, ...], float], list[int]] = {}
    for i, (ids, temperature) in enumerate(prompts):
        out.setdefault((tuple(ids), temperature), []).append(i)
    return list(out.values())
