"""Log-probabilities of tokens under the policy: the one definition sampling and training share.

A sampled token's log-prob is log_softmax(logits / temperature) at that token, in fp32 — the
local engine records it while sampling, vLLM returns it (`processed_logprobs`), and the
trainer recomputes it for the importance ratio, so the three agree by construction.

Import this module lazily: it imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) at `tokens`, in fp32; differentiable.

    logits: [B, T, V], tokens: [B, T] → [B, T]. A temperature ≤ 0 (greedy) scores the raw
    logits, as vLLM does.
    """
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(scaled, dim=-1)


def sequence_logprobs(model: torch.nn.Module, prompt_ids: Sequence[int],
                      completion_ids: Sequence[int], temperature: float) -> list[float]:
    """Log-probs of `completion_ids` after `prompt_ids` from one fresh forward pass (no grad).

    Scores with whatever adapter is active on `model`.
    """
    if not completion_ids:
        return []
    device = next(model.parameters()).device
    ids = torch.tensor([[*prompt_ids, *completion_ids]], device=device)  # [1, P + C]
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [1, P + C, V]
    start = len(prompt_ids)
    # The logits at position i predict token i + 1.
    scores = token_logprobs(logits[:, start - 1:-1], ids[:, start:], temperature)  # [1, C]
    return [float(x) for x in scores[0]]
