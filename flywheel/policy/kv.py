"""Keys/values of a prompt computed once and reused by many rows: what sampling and training share.

A prompt's keys/values depend only on its own tokens (causal attention), so one forward of
the prompt serves every completion of it: the trainer (`flywheel.trainer.prefix`) and the
local engine (`flywheel.policy.sampling`) both build their per-row caches from one prompt pass
with `kv_cache`, and cut a cached prompt at any position to continue a longer one that starts
the same way. Only full-attention decoders (Llama, SmolLM2): a sliding-window layer would need
its window applied across the cut (`unshareable` says so).

Import this module lazily: it imports torch and transformers.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache


def cache_kwarg(module: Any) -> str:
    """transformers 5.x names the cache argument `cache`; older versions `past_key_values`."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def cache_tensors(cache: DynamicCache) -> list[Tensor]:
    """Keys, values of every layer, alternating: [n, H_kv, P, D] each."""
    layers: list[Any] = list(cache.layers)
    return [t for layer in layers for t in (layer.keys, layer.values)]


def kv_cache(kv: Sequence[Tensor], n: int, length: int | None = None) -> DynamicCache:
    """A fresh cache of `kv` (per layer keys, values [1, H_kv, P, D]) for n rows, cut at
    `length` positions (None = all). Its own tensors: `kv` is never mutated, so one prompt
    serves any number of forwards."""
    cut = [t if length is None else t[:, :, :length] for t in kv]
    return DynamicCache(ddp_cache_data=[
        (cut[j].expand(n, -1, -1, -1), cut[j + 1].expand(n, -1, -1, -1))
        for j in range(0, len(cut), 2)])


def left_padded(prompts: Sequence[Sequence[Tensor]]) -> tuple[DynamicCache, Tensor | None]:
    """One cache for a batch of rows, row i holding `prompts[i]`'s keys/values [1, H_kv, P_i, D]
    (rows may share one prompt's tensors), left-padded to the longest; and the [B, P] 0/1
    attention mask, or None when no row is padded (as `generate` drops an all-ones mask).

    Pad slots hold zeros: the mask gives them weight exactly 0, whatever they hold.
    """
    width = max(p[0].shape[2] for p in prompts)
    padded: dict[int, list[Tensor]] = {}
    for p in prompts:
        if id(p) not in padded:
            gap = width - p[0].shape[2]
            padded[id(p)] = [torch.nn.functional.pad(t, (0, 0, gap, 0)) if gap else t for t in p]
    layers = [torch.cat([padded[id(p)][j] for p in prompts]) for j in range(len(prompts[0]))]
    cache = DynamicCache(ddp_cache_data=[(layers[j], layers[j + 1])
                                         for j in range(0, len(layers), 2)])
    lengths = [p[0].shape[2] for p in prompts]
    if min(lengths) == width:
        return cache, None
    device = prompts[0][0].device
    mask = (torch.arange(width, device=device)[None]
            >= torch.tensor([width - n for n in lengths], device=device)[:, None]).long()
    return cache, mask


def unshareable(model: Any) -> str | None:
    """Why this model's prompts cannot be cut and continued exactly; None when they can."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config(decoder=True)
    kinds = set(getattr(config, "layer_types", None) or [])
    if kinds - {"full_attention"}:
        return f"its layers are not all full attention ({', '.join(sorted(kinds))})"
    if not kinds and getattr(config, "sliding_window", None) and getattr(
            config, "use_sliding_window", None) is not False:
        return "it uses sliding-window attention"
    if base.get_output_embeddings() is None:
        return "it has no output head to apply to a prompt's last hidden state"
    return None
