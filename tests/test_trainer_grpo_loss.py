"""GRPO advantages and loss on tiny hand-computed tensors."""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.trainer.grpo import GRPOConfig, group_advantages, grpo_loss, pad_batch

CFG = GRPOConfig()  # eps_low 0.2, eps_high 0.28, kl_coef 0, token norm


def _finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in metrics.values())


# --- advantages ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale_std", [True, False])
def test_equal_rewards_give_exact_zero_advantages(scale_std: bool) -> None:
    # 0.1 is not exact in binary: naive (r - mean) / (std + eps) can give ~1e-11, not 0.
    for rewards in ([0.5, 0.5, 0.5, 0.5], [0.1, 0.1, 0.1], [1.0, None, 1.0], [0.0]):
        adv = group_advantages(rewards, scale_std=scale_std, eps=1e-6)
        assert adv == [None if r is None else 0.0 for r in rewards]


def test_known_rewards_scaled_and_unscaled() -> None:
    # mean 0.5, population std sqrt(4 * 0.25 / 4) = 0.5 → (±0.5) / 0.5 = ±1.
    assert group_advantages([1, 0, 0, 1], scale_std=True, eps=1e-6) == [1.0, -1.0, -1.0, 1.0]
    assert group_advantages([1, 0, 0, 1], scale_std=False, eps=1e-6) == [0.5, -0.5, -0.5, 0.5]


def test_unscored_rollouts_are_excluded_not_scored_zero() -> None:
    # Scored: [1, 0, 1] → mean 2/3, std sqrt((1/9 + 4/9 + 1/9) / 3) = sqrt(2)/3.
    # Were None scored 0, the mean would be 0.4 and every advantage would shift.
    adv = group_advantages([1.0, None, 0.0, 1.0, None], scale_std=False, eps=1e-6)
    assert adv[1] is None and adv[4] is None
    assert adv[0] == pytest.approx(1 / 3) and adv[2] == pytest.approx(-2 / 3)
    scaled = group_advantages([1.0, None, 0.0, 1.0], scale_std=True, eps=1e-6)
    std = math.sqrt(2) / 3
    assert scaled == [pytest.approx(1 / 3 / std), None, pytest.approx(-2 / 3 / std),
                      pytest.approx(1 / 3 / std)]
    assert group_advantages([None, None], scale_std=True, eps=1e-6) == [None, None]


def test_non_finite_reward_is_rejected() -> None:
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")], scale_std=True, eps=1e-6)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="eps_low"):
        GRPOConfig(eps_low=1.0)
    with pytest.raises(ValueError, match="loss_norm"):
        GRPOConfig(loss_norm="batch")  # type: ignore[arg-type]


# --- loss ---------------------------------------------------------------------------------


def test_on_policy_loss_is_minus_token_mean_advantage() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.6, 0.9]]))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -0.5])
    loss, m = grpo_loss(logp, logp.clone(), adv, mask, CFG)
    # ratio 1 everywhere: -(3 * 1 + 2 * -0.5) / 5 tokens = -0.4
    assert float(loss) == pytest.approx(-0.4)
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0)
    assert m["adv_mean"] == pytest.approx(0.4) and m["tokens"] == 5.0
    assert m["kl"] == 0.0


def _one_row(
    log_ratios: list[float], a: float, cfg: GRPOConfig = CFG
) -> tuple[float, list[float], dict[str, float]]:
    """One row, old_logp = 0, so logp is the log-ratio; returns (loss, d loss/d logp, metrics)."""
    old = torch.zeros(1, len(log_ratios))
    logp = torch.tensor([log_ratios], requires_grad=True)
    loss, m = grpo_loss(logp, old, torch.tensor([a]), torch.ones(1, len(log_ratios)), cfg)
    loss.backward()
    assert logp.grad is not None
    return float(loss.detach()), logp.grad[0].tolist(), m


def test_positive_advantage_clips_above_one_plus_eps_high() -> None:
    # A = +1, ratios 1.5 (> 1.28: clipped to 1.28) and 1.1 (inside).
    loss, grad, m = _one_row([math.log(1.5), math.log(1.1)], 1.0)
    assert loss == pytest.approx(-(1.28 + 1.1) / 2)
    # d/dlogp of -r·A / 2 tokens = -r·A / 2; the clipped token gets no gradient.
    assert grad == [0.0, pytest.approx(-1.1 / 2)]
    assert m["clip_high_frac"] == 0.5 and m["clip_low_frac"] == 0.0 and m["clip_frac"] == 0.5


def test_negative_advantage_clips_below_one_minus_eps_low() -> None:
    # A = -1, ratios 0.5 (< 0.8: min(-0.5, -0.8) = -0.8, clipped) and 0.9 (inside).
    loss, grad, m = _one_row([math.log(0.5), math.log(0.9)], -1.0)
    assert loss == pytest.approx((0.8 + 0.9) / 2)
    assert grad == [0.0, pytest.approx(0.9 / 2)]
    assert m["clip_low_frac"] == 0.5 and m["clip_high_frac"] == 0.0 and m["clip_frac"] == 0.5


def test_clip_is_one_sided() -> None:
    # Moving *against* the advantage is never clipped: the unclipped term is the smaller one.
    loss, grad, m = _one_row([math.log(0.5)], 1.0)  # min(0.5, 0.8) = 0.5
    assert loss == pytest.approx(-0.5) and grad == [pytest.approx(-0.5)]
    loss, grad, m = _one_row([math.log(1.5)], -1.0)  # min(-1.5, -1.28) = -1.5
    assert loss == pytest.approx(1.5) and grad == [pytest.approx(1.5)]
    assert m["clip_frac"] == 0.0


def test_asymmetric_clip_high() -> None:
    loss, grad, m = _one_row([math.log(1.25)], 1.0)  # 1.25 < 1 + 0.28: not clipped
    assert loss == pytest.approx(-1.25) and grad == [pytest.approx(-1.25)]
    assert m["clip_frac"] == 0.0
    loss, grad, m = _one_row([math.log(1.25)], 1.0, GRPOConfig(eps_high=0.2))  # 1.25 > 1.2
    assert loss == pytest.approx(-1.2) and grad == [0.0]
    assert m["clip_high_frac"] == 1.0


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_empty_row_contributes_nothing(norm: str) -> None:
    cfg = GRPOConfig(loss_norm=norm)  # type: ignore[arg-type]
    logp = torch.tensor([[math.log(1.1), math.log(0.9)]])
    adv = torch.tensor([1.0])
    alone, _ = grpo_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2, dtype=torch.bool), cfg)
    # A second row with no valid tokens, whose padding even holds -inf, changes nothing.
    logp2 = torch.tensor([[math.log(1.1), math.log(0.9)], [-math.inf, -math.inf]],
                         requires_grad=True)
    mask2 = torch.tensor([[True, True], [False, False]])
    loss, m = grpo_loss(logp2, torch.zeros(2, 2), torch.tensor([1.0, 5.0]), mask2, cfg)
    assert float(loss.detach()) == pytest.approx(float(alone))  # -(1.1 + 0.9) / 2 = -1.0
    assert float(loss.detach()) == pytest.approx(-1.0) and _finite(m) and m["tokens"] == 2.0
    loss.backward()
    assert logp2.grad is not None and torch.isfinite(logp2.grad).all()
    assert logp2.grad[1].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_all_empty_batch_gives_zero_finite_loss_with_grad(norm: str) -> None:
    cfg = GRPOConfig(loss_norm=norm, kl_coef=0.1)  # type: ignore[arg-type]
    logp = torch.full((2, 3), -math.inf, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, m = grpo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask, cfg,
                        ref_logp=torch.zeros(2, 3))
    assert float(loss.detach()) == 0.0 and loss.requires_grad and loss.grad_fn is not None
    assert _finite(m) and m["tokens"] == 0.0 and m["clip_frac"] == 0.0
    loss.backward()
    assert logp.grad is not None and logp.grad.tolist() == [[0.0] * 3] * 2


def test_kl_is_zero_when_policy_is_reference() -> None:
    logp = torch.log(torch.tensor([[0.3, 0.7]]))
    cfg = GRPOConfig(kl_coef=0.5)
    loss, m = grpo_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 2), cfg, ref_logp=logp)
    assert m["kl"] == 0.0 and float(loss) == pytest.approx(-1.0)  # surrogate only


def test_kl_matches_hand_computed_k3() -> None:
    # On-policy with A = 0, so only the KL term remains. d = ref - logp = ±ln 2:
    # k3(ln 2) = 2 - ln 2 - 1 = 1 - ln 2; k3(-ln 2) = 0.5 + ln 2 - 1 = ln 2 - 0.5; mean = 0.25.
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[math.log(2), -math.log(2)]])
    loss, m = grpo_loss(logp, torch.zeros(1, 2), torch.tensor([0.0]), torch.ones(1, 2),
                        GRPOConfig(kl_coef=0.1), ref_logp=ref)
    assert m["kl"] == pytest.approx(0.25) and float(loss.detach()) == pytest.approx(0.1 * 0.25)
    # dk3/dlogp = 1 - e^d: pulls logp towards ref. 0.1 · (1 - 2) / 2 and 0.1 · (1 - 0.5) / 2.
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == [pytest.approx(-0.05), pytest.approx(0.025)]
    # kl_coef = 0: reported, not penalised.
    loss0, m0 = grpo_loss(logp, torch.zeros(1, 2), torch.tensor([0.0]), torch.ones(1, 2),
                          CFG, ref_logp=ref)
    assert m0["kl"] == pytest.approx(0.25) and float(loss0.detach()) == 0.0


def test_token_and_sequence_norm_differ_on_ragged_rows() -> None:
    logp = torch.zeros(2, 3)  # on-policy: ratio 1
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = torch.tensor([2.0, -1.0])
    tok, _ = grpo_loss(logp, logp, adv, mask, GRPOConfig(loss_norm="token"))
    seq, _ = grpo_loss(logp, logp, adv, mask, GRPOConfig(loss_norm="sequence"))
    assert float(tok) == pytest.approx(-(3 * 2.0 + 1 * -1.0) / 4)  # -1.25
    assert float(seq) == pytest.approx(-(2.0 + -1.0) / 2)  # -0.5


@pytest.mark.parametrize("a", [1.0, -1.0])
def test_one_sgd_step_moves_logp_with_the_advantage(a: float) -> None:
    logits = torch.nn.Parameter(torch.zeros(1, 1, 3))  # [B, T, vocab]

    def logp_of_token_1() -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1)[..., 1]  # [B, T]

    before = logp_of_token_1().detach()
    loss, _ = grpo_loss(logp_of_token_1(), before, torch.tensor([a]), torch.ones(1, 1), CFG)
    loss.backward()
    torch.optim.SGD([logits], lr=0.5).step()
    after = logp_of_token_1().detach()
    assert (float(after) > float(before)) == (a > 0)


def test_shape_mismatch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), CFG)
    with pytest.raises(ValueError, match="mask must have"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 2), CFG)


def test_pad_batch() -> None:
    values, mask = pad_batch([[-0.1, -0.2], [], [-0.3]])
    assert values.tolist() == [[pytest.approx(-0.1), pytest.approx(-0.2)], [0.0, 0.0],
                               [pytest.approx(-0.3), 0.0]]
    assert mask.tolist() == [[True, True], [False, False], [True, False]]
    empty_values, empty_mask = pad_batch([])
    assert empty_values.shape == (0, 0) and empty_mask.dtype == torch.bool
