"""Sampling with each prompt run once: the local engine's shared-prompt generation.

A group is G rows of one prompt, and on a CPU the prompt pass dominates: running it G times
is most of the cost of a group. Here each distinct prompt runs once (`encode`), through the
decoder only, keeping its keys/values and its last hidden state; the rows of a batch start
from copies of those (left-padded when a batch holds prompts of different lengths), the first
token comes from applying the output head to the rows' stacked hidden states, and each later
token from one forward of the whole batch. Sampling follows `generate` step for step (the
same logits processors, one `multinomial` over the whole batch per step, finished rows fed
padding, stop checks after every token), so a seed draws the same random numbers either way;
with no padding and the prompt encoded in one piece, the tokens and log-probs are bit-for-bit
those of `generate` (tests/test_policy_shared.py).

A prompt can also continue one encoded earlier (`parent`, cut at `start`): the prefix cache
hands over the longest start already computed (system prompt, tools, earlier turns).

Import this module lazily: it imports torch and transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from flywheel.policy import prefix_attention
from flywheel.policy.base import SamplingParams
from flywheel.policy.kv import (
    cache_kwarg,
    cache_tensors,
    kv_cache,
    left_padded,
    make_room,
    unshareable,
)
from flywheel.policy.logprobs import token_logprobs
from flywheel.policy.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from flywheel.policy.grammar_masks import RowMasks

MIN_REUSE = 16
"""Fewest cached tokens worth continuing from (fewer: the prompt runs in full)."""


@dataclass(frozen=True)
class PromptKV:
    """One prompt's forward pass (no grad): what every row sampled after it starts from."""

    kv: list[Tensor]
    """Per layer keys, values: [1, H_kv, P, D]."""
    hidden: Tensor
    """The decoder's output (after its final norm) at the last position: [1, 1, E]."""

    @property
    def length(self) -> int:
        return int(self.kv[0].shape[2])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.kv, self.hidden))


def _parts(model: Any) -> tuple[Any, Any]:
    """The decoder stack and the output head of a causal LM (through a PEFT wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def encode(model: Any, ids: Sequence[int], parent: PromptKV | None = None,
           start: int = 0) -> PromptKV:
    """Run `ids[start:]` once, continuing `parent`'s first `start` positions (which must be
    the KV of `ids[:start]`); `start` = 0 without a parent. Call under `torch.no_grad()`."""
    if parent is None and start:
        raise ValueError(f"start={start} needs the parent prompt those positions come from")
    decoder, _ = _parts(model)
    device = next(model.parameters()).device
    cache = DynamicCache() if parent is None else kv_cache(parent.kv, 1, length=start)
    out = decoder(input_ids=torch.tensor([list(ids[start:])], device=device),
                  position_ids=torch.arange(start, len(ids), device=device)[None],
                  use_cache=True, **{cache_kwarg(decoder): cache})
    return PromptKV(cache_tensors(cache), out.last_hidden_state[:, -1:])


def head_mismatch(model: Any) -> float:
    """Largest difference between the model's own last logits and its output head applied to
    `encode`'s hidden state, on a probe: 0 for a plain decoder + head; large for a model that
    transforms its logits after the head (soft-capping, scaling), which cannot share prompts."""
    ids = list(range(1, 9))
    device = next(model.parameters()).device
    with torch.no_grad():
        full = model(input_ids=torch.tensor([ids], device=device), logits_to_keep=1).logits
        split = _parts(model)[1](encode(model, ids).hidden)
    return float((full.float() - split.float()).abs().max())


def share_blocker(model: Any) -> str | None:
    """Why `model` cannot sample from shared prompts exactly; None when it can."""
    reason = unshareable(model)
    if reason is None and (gap := head_mismatch(model)) > 1e-4:
        reason = f"its logits are not its output head's ({gap:.3g} apart on a probe)"
    return reason


Seen = dict[tuple[int, ...], tuple[PromptKV, int]]
"""The prompts one call has encoded: token ids → (encoded, tokens that came from the cache)."""


def encode_cached(model: Any, ids: list[int], adapter: str | None,
                  cache: PrefixCache[PromptKV], seen: Seen) -> tuple[PromptKV, int]:
    """`ids` encoded once per call (`seen`), continuing the longest start `cache` holds for
    `adapter` (the weights active on `model`); and how many of its tokens came from there."""
    key = tuple(ids)
    if key not in seen:
        hit = cache.lookup(adapter, ids, minimum=MIN_REUSE)
        if hit is not None and hit.exact:
            seen[key] = (hit.value, len(ids))
        else:  # at least the last token runs: its hidden state starts the rows
            start = 0 if hit is None else min(hit.shared, len(ids) - 1)
            prompt = encode(model, ids, hit.value if start and hit else None, start)
            cache.put(adapter, ids, prompt, prompt.nbytes)
            seen[key] = (prompt, start)
    return seen[key]


def _processors(params: SamplingParams) -> LogitsProcessorList:
    """The warpers `generate` builds for these params (a neutral config otherwise)."""
    warpers = LogitsProcessorList()
    if params.temperature <= 0:  # greedy: argmax of the raw logits
        return warpers
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p, min_tokens_to_keep=1))
    return warpers


def _as_generate_lays_out(rows: Sequence[PromptKV]) -> Tensor:
    """The rows' last hidden states [B, 1, E], as the last column of a [B, P, E] buffer.

    `generate` applies the head to that strided slice of the prompt pass's output; MKL can
    round the same product of a strided and of a contiguous operand differently (~1e-5), so
    the first token's logits are computed on the same layout, and come out bit-for-bit.
    """
    width = max(r.length for r in rows)
    first = rows[0].hidden
    buffer = first.new_zeros(len(rows), width, first.shape[-1])
    buffer[:, -1] = torch.cat([r.hidden for r in rows])[:, 0]
    return buffer[:, -1:]


Unit = tuple[int, int, torch.Generator | None]
"""Rows [start, stop) of a batch that draw from one generator (None = the default RNG)."""


def _draw(probs: Tensor, unfinished: Tensor, units: Sequence[Unit] | None) -> Tensor:
    """One token per row [B] from `probs` [B, V]: one `multinomial` over the batch, or one per
    unit from its own generator, skipping a unit whose rows have all ended — so each unit
    draws exactly the numbers it would alone, whatever else shares the batch."""
    if units is None:
        return torch.multinomial(probs, num_samples=1)[:, 0]
    picked = torch.zeros(probs.shape[0], dtype=torch.long, device=probs.device)
    for start, stop, gen in units:
        if bool(unfinished[start:stop].any()):
            picked[start:stop] = torch.multinomial(probs[start:stop], num_samples=1,
                                                   generator=gen)[:, 0]
    return picked


def common_start(rows: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every row has in common, leaving each row at least one of
    its own (its suffix cache is never empty)."""
    first, shortest = rows[0], min(len(r) for r in rows)
    n = 0
    while n < shortest - 1 and all(r[n] == first[n] for r in rows):
        n += 1
    return n


def sample_rows(model: Any, rows: Sequence[PromptKV], params: SamplingParams, *,
                eos_ids: set[int], pad_id: int,
                stop: Callable[[Tensor], Tensor] | None = None,
                units: Sequence[Unit] | None = None, shared: int = 0,
                in_place: bool | None = None,
                masks: RowMasks | None = None) -> tuple[Tensor, Tensor]:
    """Up to `params.max_tokens` tokens after each row's prompt: tokens [B, T] (padding after
    a row's end) and their sampling log-probs [B, T], T ≤ max_tokens.

    `stop(tokens [B, t]) → [B] bool` marks rows a stop condition has ended. Without `units`,
    draws from the caller's RNG state (seed it, fork it); with them, each unit of rows from
    its own generator, as if it ran alone (requests of several callers in one batch).
    `shared`: the first positions every row's prompt has in common; with the model on
    `prefix_attention` (and enough of them and of rows) their keys/values are read once per
    step for the whole batch instead of once per row. With units, a unit whose rows have all
    ended leaves the forward (`_compact`). `in_place` (None: on a GPU) writes each step's
    keys/values into room reserved for `max_tokens` (`kv.make_room`) instead of copying the
    cache every step. `masks`: the grammars of constrained rows
    (`flywheel.policy.grammar_masks`); each such row samples from its masked logits and its
    log-probs are the masked distribution's, other rows are untouched. Call under
    `torch.no_grad()`.
    """
    batch, device = len(rows), rows[0].hidden.device
    if params.max_tokens <= 0:
        empty = torch.zeros(batch, 0, device=device)
        return empty.long(), empty
    extra: dict[str, Any] = {}
    if shared >= prefix_attention.MIN_SHARED and batch >= prefix_attention.MIN_ROWS \
            and prefix_attention.active(model):
        extra["shared_prefix"] = prefix_attention.SharedPrefix.of(rows[0].kv, shared)
        # One suffix list per distinct prompt: left_padded pads a prompt once for its rows.
        suffix = {id(r): [t[:, :, shared:] for t in r.kv] for r in rows}
        cache, mask = left_padded([suffix[id(r)] for r in rows])
    else:
        cache, mask = left_padded([r.kv for r in rows])
    if in_place if in_place is not None else device.type == "cuda":
        make_room(cache, params.max_tokens)
    positions = torch.tensor([r.length for r in rows], device=device)  # next position per row
    eos = torch.tensor(sorted(eos_ids), device=device)
    warpers, sampling = _processors(params), params.temperature > 0
    # (the warpers `generate` would use here never read the ids)
    logits = _parts(model)[1](_as_generate_lays_out(rows))[:, -1].float()  # [B, V]
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    # The rows still in the forward (indices into the batch) and their units, re-indexed.
    alive = torch.arange(batch, device=device)
    live = list(units) if units is not None else None
    tokens: list[Tensor] = []
    logps: list[Tensor] = []
    for step in range(params.max_tokens):
        if step:
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = model(input_ids=tokens[-1][alive][:, None], attention_mask=mask,
                        position_ids=(positions[alive] + step - 1)[:, None], use_cache=True,
                        logits_to_keep=1, **{cache_kwarg(model): cache}, **extra)
            logits = out.logits[:, -1].float()  # [b, V]: the rows in the forward
        running = unfinished[alive]
        if masks is not None:
            logits = masks.mask(logits, alive, running)
        if sampling:
            no_ids = cast(torch.LongTensor, alive.new_zeros(len(alive), 0))
            drawn = _draw(torch.softmax(warpers(no_ids, logits), dim=-1), running, live)
        else:
            drawn = logits.argmax(-1)
        drawn = torch.where(running, drawn, pad_id)  # [b]
        picked = torch.full((batch,), pad_id, dtype=torch.long, device=device)
        picked[alive] = drawn
        if masks is not None:
            masks.advance(picked, unfinished)
        logp = torch.zeros(batch, device=device)
        logp[alive] = token_logprobs(logits[:, None], drawn[:, None], params.temperature)[:, 0]
        tokens.append(picked)
        logps.append(logp)
        done = torch.isin(picked, eos)
        if stop is not None:
            done |= stop(torch.stack(tokens, 1))
        unfinished &= ~done
        if not bool(unfinished.any()):
            break
        if live is not None:
            alive, live, mask = _compact(cache, alive, live, unfinished, mask)
    return torch.stack(tokens, 1), torch.stack(logps, 1)


def _compact(cache: DynamicCache, alive: Tensor, live: list[Unit], unfinished: Tensor,
             mask: Tensor | None) -> tuple[Tensor, list[Unit], Tensor | None]:
    """Drop from the forward the units whose rows have all ended, once they are a quarter of
    it (each drop copies the survivors' keys/values): a finished row costs a decode step as
    much as a live one, and a batch runs until its longest row ends. Only whole units go, so
    every unit still draws what it would alone (`_draw` skips an ended unit anyway); without
    units one `multinomial` draws for every row, and no row may leave.
    """
    ended = [not bool(unfinished[alive[a:b]].any()) for a, b, _ in live]
    dropped = sum(b - a for (a, b, _), gone in zip(live, ended, strict=True) if gone)
    if not dropped or 4 * dropped < len(alive):
        return alive, live, mask
    keep: list[Tensor] = []
    kept: list[Unit] = []
    for (a, b, gen), gone in zip(live, ended, strict=True):
        if not gone:
            start = kept[-1][1] if kept else 0
            kept.append((start, start + b - a, gen))
            keep.append(torch.arange(a, b, device=alive.device))
    index = torch.cat(keep)
    layers: list[Any] = list(cache.layers)
    for layer in layers:
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)
    return alive[index], kept, None if mask is None else mask.index_select(0, index)
