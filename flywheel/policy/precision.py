"""Low-precision weights with fp32 log-probs: what the engine and the trainer share on a GPU.

On a GPU the decoder runs in bf16 (its tensor cores are ~10× the fp32 rate, its weights
half the bytes to read per decode step), but a log-prob is the difference of two logits
of magnitude ~10–30, and bf16 keeps 8 bits of mantissa: a bf16 logit is off by up to
~0.06, so would be the log-prob, and exp(±0.06) moves an importance ratio by 6% — a third
of the clip range. So the output head stays fp32 (`Fp32Head`: an fp32 copy of its weight,
applied to the final hidden state upcast to fp32, in IEEE fp32 even where TF32 is allowed):
the logits every log-prob, importance ratio and sampling distribution is computed from are
fp32 products of bf16 hidden states, for the engine (sampling log-probs) and the trainer
(the log-probs it compares with them) alike. The rest (`flywheel.policy.logprobs`,
`flywheel.trainer.grpo`) already computes in fp32 from there.

`precision` settings: `auto` = bf16 on a CUDA GPU that supports it, fp32 elsewhere (the CPU
path unchanged); `fp32`; `bf16` (also on the CPU: slow but correct, the tests use it).

Import this module lazily: it imports torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor

Precision = Literal["auto", "fp32", "bf16"]


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype the decoder's weights take for `precision` on `device`."""
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    if precision != "auto":
        raise ValueError(f"precision must be auto, fp32 or bf16, got {precision!r}")
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def allow_tf32(device: torch.device) -> None:
    """On CUDA, let fp32 matmuls use TF32 (the LoRA products left in fp32 next to a bf16
    base: 10 bits of mantissa where their inputs already went through bf16 layers). Only
    called for bf16 runs: an fp32 run stays IEEE fp32, the reference the tests compare to."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


@contextmanager
def ieee_fp32() -> Iterator[None]:
    """fp32 matmuls in full IEEE precision inside, whatever TF32 setting is outside."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


class Fp32Head(torch.nn.Module):
    """An output head computing fp32 logits [..., V] from hidden states [..., E] of any
    dtype, with an fp32 weight [V, E] that is never trained (a buffer, not saved)."""

    weight32: Tensor

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.register_buffer("weight32", weight.detach().float().clone(), persistent=False)

    def forward(self, hidden: Tensor) -> Tensor:
        with ieee_fp32():
            return torch.nn.functional.linear(hidden.float(), self.weight32)


def to_low_precision(model: Any, dtype: torch.dtype) -> Any:
    """`model` (a causal LM in fp32) with its weights cast to `dtype` and its output head
    replaced by an `Fp32Head` holding the fp32 weight it had (a tied head is untied: the
    input embeddings take `dtype`, the head keeps fp32). fp32 returns `model` untouched."""
    if dtype == torch.float32:
        return model
    head = model.get_output_embeddings()
    if head is None or head.weight.dtype != torch.float32:
        raise ValueError("to_low_precision needs a causal LM with an output head, in fp32")
    fp32 = Fp32Head(head.weight)
    model.to(dtype)
    model.set_output_embeddings(fp32)
    # Nothing may tie the bf16 embeddings back onto the fp32 head (save/load, resize).
    model.config.tie_word_embeddings = False
    return model


def is_low_precision(model: Any) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return isinstance(base.get_output_embeddings(), Fp32Head)
