"""Attention over a prefix every row of a batch shares, read once per step (cascade attention).

A batch of the local engine often holds rows that start alike: a group is G rows of one
prompt, and a gate round's tasks share the system prompt and the tool schemas (1,700 tokens
with 13 tools). Decoding them the plain way gives every row its own copy of those keys and
values: each step copies and reads the prefix once per row, and on a CPU that memory traffic,
not the arithmetic, sets the pace (SmolLM2-135M: 45 KiB a token a row; 32 rows × 1,717
tokens is 2.5 GB a step, against 540 MB of weights). Here the shared prefix's keys/values
are held once ([H_kv, C, D]) and each row's cache holds only what follows it; a layer's
attention is computed in two parts — every row's queries against the prefix in one matrix
product per key/value head, and each row against its own suffix — and merged exactly by
their log-sum-exp (the same softmax over the concatenated keys, rounded differently).

It is an attention implementation registered with transformers (`AttentionInterface`), so
the model's own layers run as ever (norms, rotary embeddings, LoRA on the projections, MLP):
a forward without the `shared_prefix` keyword is plain SDPA, bit for bit, and prompts are
encoded that way. Only decoders whose attention modules take the interface (Llama, SmolLM2
and most of transformers' decoders); `enable` probes the model and says why not otherwise.

It imports torch and transformers: only the engine's own modules (`sampling`, `local`)
import it, and they are imported lazily themselves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from flywheel.policy.kv import cache_kwarg, cache_tensors, kv_cache, left_padded

NAME = "flywheel_prefix"
MIN_SHARED = 64
"""Fewest shared tokens for the split (below, the plain path). A chosen bound, not a
measured break-even: the split costs two small products more per layer, and was measured
faster from 444 shared tokens and 8 rows up (docs/BENCHMARKS.md)."""
MIN_ROWS = 2


@dataclass(frozen=True)
class SharedPrefix:
    """The keys, values of the first `length` positions of every row: per layer [H_kv, C, D]."""

    kv: list[Tensor]

    @classmethod
    def of(cls, kv: Sequence[Tensor], length: int) -> SharedPrefix:
        """Cut from one row's per-layer keys, values [1, H_kv, P, D] (views, no copy)."""
        return cls([t[0, :, :length] for t in kv])

    @property
    def length(self) -> int:
        return int(self.kv[0].shape[1])


def _attend(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
            scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Unnormalised attention of `query` [..., T, D] on `key`/`value` [..., S, D]: the
    output Σ e·v, the row max m and the sum Σ e, with e = exp(s − m); all fp32.

    In fp32 whatever the inputs' dtype: SDPA's kernels keep scores, exponentials and sums in
    fp32 and round only the output; done in bf16 here, the scores would be rounded (±0.4%
    of a score of ~10 moves its weight by ~4%), the sum of hundreds of bf16 exponentials
    loses their small terms, and the two parts' merge rounds twice — the 0.029 a bf16 probe
    measured. An fp32 input is used as is (no copy): the fp32 path is unchanged."""
    query, key, value = query.float(), key.float(), value.float()
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if mask is not None:
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask)
    peak = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - peak)
    return torch.matmul(weights, value), peak, weights.sum(-1, keepdim=True)


def prefix_attention(module: Any, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, dropout: float = 0.0,
                     scaling: float | None = None, shared_prefix: SharedPrefix | None = None,
                     **kwargs: Any) -> tuple[Tensor, None]:
    """`query` [B, H, T, D] on the shared prefix, then on `key`/`value` [B, H_kv, S, D] (each
    row's own positions after it, masked by `attention_mask`); [B, T, H, D] as SDPA returns."""
    if shared_prefix is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    k_p, v_p = shared_prefix.kv[2 * module.layer_idx], shared_prefix.kv[2 * module.layer_idx + 1]
    batch, heads, steps, dim = query.shape
    kv_heads = k_p.shape[0]
    group = heads // kv_heads  # query head h reads key/value head h // group (repeat_kv)
    scale = scaling if scaling is not None else dim ** -0.5
    grouped = query.reshape(batch, kv_heads, group, steps, dim)
    # Every row's queries against the prefix: one product per key/value head.
    flat = grouped.permute(1, 0, 2, 3, 4).reshape(kv_heads, batch * group * steps, dim)
    out_p, peak_p, sum_p = _attend(flat, k_p, v_p, None, scale)

    def back(t: Tensor) -> Tensor:
        return t.reshape(kv_heads, batch, group, steps, -1).permute(1, 0, 2, 3, 4)
    out_p, peak_p, sum_p = back(out_p), back(peak_p), back(sum_p)
    # Each row against its own suffix: a key/value head's `group` query heads stacked as rows
    # of one product ([B, H_kv, group·T, D] on [B, H_kv, S, D]), so the suffix is read as it
    # is — broadcasting it over the group instead copies it `group` times a layer a step.
    mask = None
    if attention_mask is not None:  # sdpa_mask's [B, 1, T, S] → [B, 1, group·T, S]
        mask = (attention_mask[:, :, None].expand(-1, -1, group, -1, -1)
                .reshape(batch, attention_mask.shape[1], group * steps, -1))
    out_s, peak_s, sum_s = _attend(grouped.reshape(batch, kv_heads, group * steps, dim),
                                   key, value, mask, scale)
    out_s, peak_s, sum_s = (t.reshape(batch, kv_heads, group, steps, -1)
                            for t in (out_s, peak_s, sum_s))
    peak = torch.maximum(peak_p, peak_s)
    a, b = torch.exp(peak_p - peak), torch.exp(peak_s - peak)
    out = (out_p * a + out_s * b) / (sum_p * a + sum_s * b)  # fp32: rounded once, below
    return (out.reshape(batch, heads, steps, dim).transpose(1, 2).contiguous()
            .to(query.dtype), None)


def _register() -> None:
    AttentionInterface.register(NAME, prefix_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def active(model: Any) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base.config, "_attn_implementation", None) == NAME


def enable(model: Any) -> str | None:
    """Switch `model` to this attention and check it on a probe; None when on, else why
    not (the model is left on SDPA).

    The probe runs in fp32 whatever the model's dtype (its 16-bit weights upcast for the
    probe and restored bit for bit): it checks that the split computes the same function as
    the plain step (within 1e-3; measured ≤ 1e-5), which rounding noise would blur in bf16
    (two bf16 paths through 30 layers differ by ~1e-2 however right both are). The split's
    own bf16 rounding is tested against exact attention (tests/test_policy_prefix_attention.py).
    """
    _register()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "_attn_implementation", None) not in ("sdpa", NAME):
        return f"its attention is {base.config._attn_implementation!r}, not SDPA"
    try:
        base.set_attn_implementation(NAME)
        with _in_fp32(model):
            gap = _probe(model)
    except Exception as err:  # an architecture that does not take the interface
        base.set_attn_implementation("sdpa")
        return f"it does not take a registered attention ({type(err).__name__}: {err})"
    if gap > 1e-3:
        base.set_attn_implementation("sdpa")
        return f"a split decode step is {gap:.3g} away from the plain one on a probe"
    return None


@contextmanager
def _in_fp32(model: Any) -> Iterator[None]:
    """`model`'s 16-bit parameters and buffers in fp32 inside (exact both ways: every bf16
    or fp16 value is an fp32 value)."""
    low = [t for t in (*model.parameters(), *model.buffers())
           if t.dtype in (torch.bfloat16, torch.float16)]
    dtypes = [t.dtype for t in low]
    try:
        for t in low:
            t.data = t.data.float()
        yield
    finally:
        for t, dtype in zip(low, dtypes, strict=True):
            t.data = t.data.to(dtype)


def _probe(model: Any) -> float:
    """Largest logit difference between one decode step over a 12-token prompt split at 8
    (prefix shared by two rows) and the plain step over the whole cache, divided by the
    largest plain logit when that exceeds 1."""
    device = next(model.parameters()).device
    ids = torch.arange(1, 13, device=device)[None]
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        kv = cache_tensors(cache)
        step = dict(input_ids=torch.tensor([[5], [7]], device=device),
                    position_ids=torch.tensor([[12], [12]], device=device), use_cache=True,
                    logits_to_keep=1)
        plain = model(**step, **{cache_kwarg(model): kv_cache(kv, 2)}).logits
        suffix, _ = left_padded([[t[:, :, 8:] for t in kv]] * 2)
        split = model(**step, **{cache_kwarg(model): suffix},
                      shared_prefix=SharedPrefix.of(kv, 8)).logits
    scale = max(1.0, float(plain.float().abs().max()))
    return float((plain.float() - split.float()).abs().max()) / scale
