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
from transformers.cache_utils import DynamicLayer


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


class _RoomyLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A `DynamicLayer` whose keys/values are views into buffers with room to grow: a decode
    step writes its position in place instead of concatenating (which copies the whole cache
    every step: on a GPU, at 128 rows of ~500 tokens, more bytes a step than the weights).
    Attention reads the same values either way; on a CPU, MKL may round the same product of
    a strided and of a contiguous operand differently (~1e-7), so the CPU keeps `cat`."""

    room: int = 0
    _buffers: tuple[Tensor, Tensor] | None = None

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        old_k, old_v = self.keys, self.values
        if not self.is_initialized or old_k is None or old_v is None or old_k.numel() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        n, t = old_k.shape[-2], key_states.shape[-2]
        held = self._buffers
        if (held is None or n + t > held[0].shape[-2] or held[0].shape[0] != old_k.shape[0]
                or held[0].untyped_storage().data_ptr() != old_k.untyped_storage().data_ptr()):
            # First step, or the rows were compacted (new tensors): room for what is left.
            size = n + max(t, self.room)
            keys = old_k.new_empty(*old_k.shape[:-2], size, old_k.shape[-1])
            values = old_v.new_empty(*old_v.shape[:-2], size, old_v.shape[-1])
            keys[..., :n, :] = old_k
            values[..., :n, :] = old_v
            held = self._buffers = (keys, values)
        held[0][..., n:n + t, :] = key_states
        held[1][..., n:n + t, :] = value_states
        self.keys, self.values = held[0][..., :n + t, :], held[1][..., :n + t, :]
        return self.keys, self.values


def make_room(cache: DynamicCache, positions: int) -> DynamicCache:
    """Let every layer of `cache` grow by `positions` in place (`_RoomyLayer`), from the next
    update on; its current keys/values are untouched."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer or isinstance(layer, _RoomyLayer):
            layer.__class__ = _RoomyLayer
            layer.room = positions  # type: ignore[attr-defined]
    return cache
