"""Shared prompts on the real model: each prompt (and the prefix all prompts share) runs
once, and the log-probs, losses and LoRA gradients of GRPO and SFT are those of running every
prompt + completion in full."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from flywheel.policy.model_cache import resolve_model_dir
from flywheel.trainer.engine import LoRASpec, LoRATrainer, Sample, _batch
from flywheel.trainer.grpo import GRPOConfig
from flywheel.trainer.prefix import completion_logps, encode_prompt
from flywheel.trainer.sft import IGNORE, SFTExample, sft_backward

# Two groups (prompt A: 3 completions, prompt B: 2) and a lone later-turn prompt C, all
# starting with the same ROOT tokens then tails of their own. With micro_batch=2, A's
# completions run as [5, 9] then [1] (a one-token completion needs only the prompt's last
# logit), so A's leaves collect gradient from two micro-batches.
ROOT = 24
TAILS = {"A": 16, "B": 7, "C": 11}
ROWS = [("A", 5, 1.0), ("A", 9, -0.5), ("A", 1, 0.7), ("B", 7, -1.2), ("B", 3, 0.3),
        ("C", 4, 0.9)]


@pytest.fixture(scope="module")
def trainer() -> Iterator[LoRATrainer]:
    torch.manual_seed(0)
    t = LoRATrainer(resolve_model_dir(None), lora=LoRASpec(r=4, alpha=8), grpo=GRPOConfig(),
                    lr=1e-3, micro_batch=2)
    with torch.no_grad():  # a non-zero adapter: policy ≠ reference, and lora_A gets gradient
        for name, p in t.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    yield t


@pytest.fixture(scope="module")
def samples(trainer: LoRATrainer) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    root = torch.randint(100, 40000, (ROOT,), generator=g).tolist()
    prompts = {k: root + torch.randint(100, 40000, (n,), generator=g).tolist()
               for k, n in TAILS.items()}
    drafts = [Sample(prompts[k], torch.randint(100, 40000, (n,), generator=g).tolist(),
                     [0.0] * n, adv, 1.0) for k, n, adv in ROWS]
    with torch.no_grad():  # old log-probs near the current ones: ratios ≠ 1, some clipped
        b = _batch(drafts, trainer.pad_id)
        logp = trainer._logps(b, 1.0)
    out = []
    for i, s in enumerate(drafts):
        n = len(s.completion_ids)
        old = logp[i, -n:] + 0.15 * torch.randn(n, generator=g)
        out.append(Sample(s.prompt_ids, s.completion_ids, old.tolist(), s.advantage, 1.0))
    return out


@pytest.mark.parametrize("adapter", [True, False])
@pytest.mark.parametrize("via_root", [False, True])
def test_shared_prompt_log_probs_equal_full_sequences(trainer: LoRATrainer,
                                                      samples: list[Sample], adapter: bool,
                                                      via_root: bool) -> None:
    context = contextlib.nullcontext() if adapter else trainer.model.disable_adapter()
    worst = 0.0
    with torch.no_grad(), context:
        naive = trainer._logps(_batch(samples, trainer.pad_id), 1.0)
        root = encode_prompt(trainer.model, samples[0].prompt_ids[:ROOT]) if via_root else None
        for group in (samples[0:3], samples[3:5]):
            ids = group[0].prompt_ids[ROOT:] if via_root else group[0].prompt_ids
            prompt = encode_prompt(trainer.model, ids, root)
            shared = completion_logps(trainer.model, prompt, [s.completion_ids for s in group],
                                      trainer.pad_id, 1.0)
            for j, s in enumerate(group):
                n = len(s.completion_ids)
                row = samples.index(s)
                worst = max(worst, float((shared[j, :n] - naive[row, -n:]).abs().max()))
    assert worst < 1e-4


@pytest.mark.parametrize(("loss_norm", "kl_coef"),
                         [("token", 0.0), ("token", 0.05), ("sequence", 0.05)])
def test_shared_prompt_gradient_equals_full_sequences(trainer: LoRATrainer,
                                                      samples: list[Sample], loss_norm: str,
                                                      kl_coef: float) -> None:
    trainer.grpo = GRPOConfig(loss_norm=loss_norm, kl_coef=kl_coef)  # type: ignore[arg-type]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    runs = []
    for share in (False, True):
        trainer.optimizer.zero_grad(set_to_none=True)
        metrics = trainer.backward(samples, share_prompts=share)
        grads = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
        runs.append((metrics, grads))
    trainer.optimizer.zero_grad(set_to_none=True)
    (naive_m, naive_g), (shared_m, shared_g) = runs
    assert naive_g.shape == shared_g.shape == torch.Size([sum(p.numel() for p in params)])
    assert float(naive_g.norm()) > 0
    assert float((shared_g - naive_g).norm() / naive_g.norm()) < 1e-3
    assert shared_m["loss"] == pytest.approx(naive_m["loss"], rel=1e-4, abs=1e-6)
    if loss_norm == "token":  # with "sequence", metric means are weighted per micro-batch
        assert shared_m["clip_frac"] == pytest.approx(naive_m["clip_frac"], abs=1e-9)
        assert 0 < naive_m["clip_frac"] < 0.5
        assert shared_m["kl"] == pytest.approx(naive_m["kl"], rel=1e-3)
        assert (naive_m["kl"] > 0) == (kl_coef > 0)


def test_each_shared_prompt_runs_once(trainer: LoRATrainer, samples: list[Sample]) -> None:
    trainer.grpo = GRPOConfig()
    shapes: list[tuple[int, ...]] = []
    embed = trainer.model.get_input_embeddings()
    hook = embed.register_forward_hook(lambda _m, args, _o: shapes.append(tuple(args[0].shape)))
    try:
        trainer.backward(samples)
    finally:
        hook.remove()
        trainer.optimizer.zero_grad(set_to_none=True)
    # The shared root once; A's tail once, its completions [5, 9] minus their last token
    # (the 1-token one needs no pass); B's tail once and [7, 3]; C's tail and [4].
    assert shapes == [(1, ROOT), (1, 16), (2, 8), (1, 7), (2, 6), (1, 11), (1, 3)]


def test_sft_with_a_shared_prefix_is_the_same_gradient(trainer: LoRATrainer) -> None:
    g = torch.Generator().manual_seed(2)
    root = torch.randint(100, 40000, (ROOT,), generator=g).tolist()
    examples = []
    for tail, target in [(9, 6), (4, 1), (13, 8), (6, 3), (2, 5)]:
        prompt = root + torch.randint(100, 40000, (tail,), generator=g).tolist()
        completion = torch.randint(100, 40000, (target,), generator=g).tolist()
        examples.append(SFTExample([*prompt, *completion], [IGNORE] * len(prompt) + completion))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    runs = []
    for share in (False, True):
        trainer.optimizer.zero_grad(set_to_none=True)
        loss, hits = sft_backward(trainer.model, examples, pad_id=trainer.pad_id,
                                  micro_batch=2, share_prefix=share)
        runs.append((loss, hits, torch.cat([p.grad.flatten() for p in params
                                            if p.grad is not None])))
    trainer.optimizer.zero_grad(set_to_none=True)
    (naive_loss, naive_hits, naive_g), (shared_loss, shared_hits, shared_g) = runs
    assert naive_g.shape == shared_g.shape and float(naive_g.norm()) > 0
    assert float((shared_g - naive_g).norm() / naive_g.norm()) < 1e-3
    assert shared_loss == pytest.approx(naive_loss, rel=1e-5)
    assert shared_hits == naive_hits


def test_sft_projects_only_the_target_columns_onto_the_vocabulary(trainer: LoRATrainer) -> None:
    """A multi-turn demonstration is hundreds of conversation tokens before a short reply:
    the shared-prefix SFT pass computes logits where some example of the micro-batch has a
    target, not at every position ([K, V] fp32 a row would dwarf the activations)."""
    g = torch.Generator().manual_seed(3)
    root = torch.randint(100, 40000, (ROOT,), generator=g).tolist()
    examples = []
    for context, target in [(40, 3), (25, 2)]:  # long context, short reply
        prompt = root + torch.randint(100, 40000, (context,), generator=g).tolist()
        completion = torch.randint(100, 40000, (target,), generator=g).tolist()
        examples.append(SFTExample([*prompt, *completion], [IGNORE] * len(prompt) + completion))
    head = trainer.model.get_output_embeddings()
    positions: list[int] = []
    hook = head.register_forward_hook(lambda _m, args, _o: positions.append(args[0].shape[1]))
    try:
        trainer.optimizer.zero_grad(set_to_none=True)
        sft_backward(trainer.model, examples, pad_id=trainer.pad_id, micro_batch=2,
                     share_prefix=True)
    finally:
        hook.remove()
        trainer.optimizer.zero_grad(set_to_none=True)
    # The root's pass keeps its last position; the rest: targets at columns 40-42 and 25-26
    # of the tails, each predicted from the column before.
    assert positions == [1, 5]
