"""GRPO math: group-relative advantages and the clipped policy-gradient loss.

Pure functions, no I/O. The trainer feeds them one trainable `GroupScored` group at a time:
rewards → `group_advantages`, the sampling log-probs stored in each `Turn` → `old_logp`, and
log-probs recomputed under the current adapter → `logp`. Both log-probs must be taken at the
same sampling temperature, or the ratio is off before any update.

Unscored rollouts (reward None) get advantage None and must be dropped by the caller: a
rollout that did not run says nothing about the policy, so it is never scored 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class GRPOConfig:
    """The knobs of one GRPO update."""

    eps_low: float = 0.2
    """The ratio may fall to 1 − eps_low before a negative advantage stops pushing it down."""
    eps_high: float = 0.28
    """The ratio may rise to 1 + eps_high; wider than eps_low ("clip-higher", DAPO) so rare
    tokens with a positive advantage can still gain probability."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty towards the reference policy; 0 disables the penalty."""
    scale_std: bool = True
    """Divide advantages by the group's reward std (False = Dr. GRPO: mean-centring only)."""
    loss_norm: Literal["token", "sequence"] = "token"
    """token: every valid token in the batch weighs the same (DAPO); sequence: every sequence
    weighs the same, whatever its length (original GRPO)."""
    std_eps: float = 1e-6
    """Floor of the group std, so near-equal rewards cannot blow advantages up."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"eps_high must be ≥ 0, got {self.eps_high}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be ≥ 0, got {self.kl_coef}")
        if self.std_eps <= 0.0:
            raise ValueError(f"std_eps must be > 0, got {self.std_eps}")
        if self.loss_norm not in ("token", "sequence"):
            raise ValueError(f"loss_norm must be 'token' or 'sequence', got {self.loss_norm!r}")


def group_advantages(
    rewards: Sequence[float | None], *, scale_std: bool, eps: float
) -> list[float | None]:
    """Advantage of each rollout relative to the scored rollouts of its own group.

    None (did not run) stays None and is left out of the mean and std. A group whose scored
    rewards are all equal carries no signal: all advantages are exactly 0.
    """
    scored = [r for r in rewards if r is not None]
    if any(not math.isfinite(r) for r in scored):
        raise ValueError(f"rewards must be finite numbers or None, got {list(rewards)}")
    if not scored:
        return [None] * len(rewards)
    if max(scored) == min(scored):
        # Checked explicitly: r − mean can be ±1e-17 after rounding, and /eps would inflate it.
        return [None if r is None else 0.0 for r in rewards]
    mean = math.fsum(scored) / len(scored)
    scale = 1.0
    if scale_std:
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in scored) / len(scored))  # population
        scale = max(std, eps)
    return [None if r is None else (r - mean) / scale for r in rewards]


def pad_batch(
    seqs: Sequence[Sequence[float]], *, pad_value: float = 0.0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Right-pad ragged rows into (values [B, T], mask [B, T] bool), T = the longest row."""
    width = max((len(s) for s in seqs), default=0)
    values = torch.full((len(seqs), width), pad_value, dtype=dtype)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            values[i, : len(s)] = torch.tensor(list(s), dtype=dtype)
            mask[i, : len(s)] = True
    return values, mask


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: GRPOConfig,
    ref_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO surrogate (+ optional k3 KL) → (scalar loss to minimise, metrics).

    logp [B, T]: log-probs of the sampled tokens under the policy being trained (has grad).
    old_logp [B, T]: their log-probs at sampling time.  advantages [B]: one per sequence.
    mask [B, T] bool/float: the completion tokens that count.  ref_logp [B, T]: reference
    policy log-probs, for the KL penalty and the `kl` metric.  Values under mask=False are
    ignored, even -inf/NaN; a row or batch without valid tokens contributes 0, never NaN.
    """
    _check_shapes(logp, old_logp, advantages, mask, ref_logp)
    valid = mask.bool()                                                     # [B, T]
    zero = logp.new_zeros((), dtype=torch.float32)
    # Zero padding *before* exp: a -inf there would otherwise leak NaN into value and grad.
    lp = torch.where(valid, logp.float(), zero)                             # [B, T]
    old = torch.where(valid, old_logp.detach().float(), zero)               # [B, T]
    adv = advantages.detach().float()[:, None]                              # [B, 1]
    ratio = torch.exp(lp - old)                                             # [B, T]
    clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)            # [B, T]
    per_token = -torch.minimum(ratio * adv, clipped * adv)                  # [B, T]
    kl: Tensor | None = None
    if ref_logp is not None:
        d = torch.where(valid, ref_logp.detach().float(), zero) - lp        # [B, T]
        kl = torch.exp(d) - d - 1.0                                          # k3 ≥ 0, [B, T]
        if cfg.kl_coef > 0.0:
            per_token = per_token + cfg.kl_coef * kl
    per_token = torch.where(valid, per_token, zero)                         # [B, T]
    n_seq = valid.sum(dim=1)                                                # [B]
    if cfg.loss_norm == "token":
        loss = per_token.sum() / n_seq.sum().clamp(min=1)
    else:
        seq_mean = per_token.sum(dim=1) / n_seq.clamp(min=1)                # [B]
        loss = seq_mean.sum() / (n_seq > 0).sum().clamp(min=1)
    return loss, _metrics(loss, ratio, adv, valid, kl, cfg)


def _metrics(
    loss: Tensor, ratio: Tensor, adv: Tensor, valid: Tensor, kl: Tensor | None, cfg: GRPOConfig
) -> dict[str, float]:
    """Token means over valid tokens; 0.0 (not NaN) when there are none, or `kl` without ref."""
    with torch.no_grad():
        tokens = int(valid.sum())
        n = max(tokens, 1)

        def mean(x: Tensor) -> float:
            return float(torch.where(valid, x.float(), 0.0).sum()) / n

        # The clip is active only where min() picks the clipped term and it differs.
        high = (adv > 0) & (ratio > 1.0 + cfg.eps_high)
        low = (adv < 0) & (ratio < 1.0 - cfg.eps_low)
        return {
            "loss": float(loss.detach()),
            "clip_frac": mean(high | low),
            "clip_low_frac": mean(low),
            "clip_high_frac": mean(high),
            "ratio_mean": mean(ratio),
            "kl": 0.0 if kl is None else mean(kl),
            "adv_mean": mean(adv.expand_as(ratio)),
            "tokens": float(tokens),
        }


def _check_shapes(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, ref_logp: Tensor | None
) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    named = {"old_logp": old_logp, "mask": mask}
    if ref_logp is not None:
        named["ref_logp"] = ref_logp
    for name, t in named.items():
        if t.shape != logp.shape:
            raise ValueError(
                f"{name} must have logp's shape {tuple(logp.shape)}, got {tuple(t.shape)}"
            )
    if advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"advantages must be [B] = {tuple(logp.shape[:1])}, got {tuple(advantages.shape)}"
        )
