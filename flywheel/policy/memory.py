"""How much work fits in a GPU's free memory: a model's shape, and the rows of one forward.

Pure arithmetic, no torch: the local engine sizes its batches with it (rows per forward
from the memory left after the weights, instead of a fixed count), and the trainer sizes its
micro-batches with the same shape (`flywheel.trainer.precision`). The figures are upper
estimates of what a forward holds, not measurements; callers pass a share of the free
memory, never all of it, for what the estimate leaves out (allocator fragmentation, the
prefix cache, kernels' workspaces).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that set its memory per token."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From a Hugging Face config (a text config, or a model config holding one)."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
            else config
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(hidden=int(text.hidden_size), intermediate=int(text.intermediate_size),
                   layers=int(text.num_hidden_layers), heads=heads,
                   kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                   head_dim=int(head_dim), vocab=int(text.vocab_size))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values of one token across all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def params(self) -> int:
        """Weights, counted as a Llama-style decoder: attention, gated MLP, embeddings and
        an untied head (the head's product costs the same whether tied or not)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + 2 * self.vocab * self.hidden


def available_bytes() -> int | None:
    """The memory the kernel says is available to a new allocation (`MemAvailable` in
    /proc/meminfo), None where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def engine_rows(budget_bytes: float, shape: ModelShape, tokens_per_row: int, *,
                dtype_bytes: int, floor: int = 1, cap: int = 1024) -> int:
    """Rows the local engine may decode in one forward within `budget_bytes`.

    A row holds its own keys/values for `tokens_per_row` positions (prompt + completion:
    the plain path copies a prompt's cache into every row; shared-prefix attention needs
    less) and, while a step runs, the cache's growth by one position per layer (the cache
    is concatenated, so a layer's old and new tensors coexist) and its logits (fp32, three
    [V] buffers: the head's output, the upcast, the softmax). Dropping finished rows
    (`sampling._compact`) copies the survivors' cache once more: counted as a second copy.
    Between `floor` and `cap`.
    """
    kv = shape.kv_bytes_per_token(dtype_bytes) * max(tokens_per_row, 1)
    per_row = 2 * kv + 3 * 4 * shape.vocab + 8 * shape.hidden * dtype_bytes
    return max(floor, min(cap, int(budget_bytes // per_row)))


def train_rows(budget_bytes: float, shape: ModelShape, *, prompt_tokens: int,
               completion_tokens: int, dtype_bytes: int, checkpointing: bool = False,
               floor: int = 1, cap: int = 256) -> int:
    """Completions the trainer may put in one forward/backward within `budget_bytes`.

    Shared prompts (`flywheel.trainer.prefix`, no checkpointing): the prompt's pass and its
    graph are held while its completions run (`prompt_tokens` of activations, once); each
    completion of `completion_tokens` keeps its activations for the backward — per token and
    layer ~(6·hidden + 4·intermediate) values in the weights' dtype (projection inputs,
    rotated q/k, attention output, the gated MLP's four) and the fp32 copies LoRA casts its
    inputs to (q, k, v, o) and the norms upcast — a copy of the prompt's keys/values grown by
    its own, and fp32 logits with their log-softmax (3 × [V] fp32 a token).
    With `checkpointing` every sequence runs in full (prompt + completion) and keeps only
    each layer's input; one layer's activations are rebuilt at a time.
    Between `floor` and `cap`.
    """
    layer_token = dtype_bytes * (6 * shape.hidden + 4 * shape.intermediate) + 4 * 6 * shape.hidden
    logits = 3 * 4 * shape.vocab * completion_tokens
    if checkpointing:
        tokens = prompt_tokens + completion_tokens
        per_row = (tokens * shape.layers * shape.hidden * dtype_bytes + tokens * layer_token
                   + logits)
        held = 0
    else:
        kv = shape.kv_bytes_per_token(dtype_bytes) * (prompt_tokens + completion_tokens)
        per_row = completion_tokens * shape.layers * layer_token + kv + logits
        held = prompt_tokens * shape.layers * layer_token
    if per_row <= 0:  # nothing to hold a row for
        return cap
    return max(floor, min(cap, int((budget_bytes - held) // per_row)))
