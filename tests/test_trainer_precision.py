"""The trainer in bf16 (the GPU default) against fp32, on the CPU: a tiny random-init model of
the bundled config's family, the same adapter, the same samples.

bf16 base weights with an fp32 head, fp32 LoRA parameters, log-probs, ratios and loss
(`flywheel.policy.precision`): the GRPO gradient of every LoRA tensor is within 5% of fp32's
(relative L2; measured 0.5–1.3% on this model), the loss within 0.02 absolute (measured
4e-5), the completion log-probs within 0.01 (measured 0.002); every trained tensor and AdamW
moment stays fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from flywheel.bench.gpu import build_model  # noqa: E402
from flywheel.policy.precision import Fp32Head  # noqa: E402
from flywheel.trainer.engine import LoRASpec, LoRATrainer, Sample, _batch  # noqa: E402
from flywheel.trainer.grpo import GRPOConfig  # noqa: E402
from tests.support.gpu_models import (  # noqa: E402
    GRAD_TOL,
    LOGP_TOL,
    LOSS_TOL,
    model_dir_for_tests,
)


def _trainer(model_dir: Path, precision: str, micro_batch: int | None = 3) -> LoRATrainer:
    torch.manual_seed(1)
    return LoRATrainer(model_dir, lora=LoRASpec(r=4, alpha=8),
                       grpo=GRPOConfig(kl_coef=0.05), lr=1e-3, micro_batch=micro_batch,
                       device="cpu", precision=precision,
                       base_model=build_model(model_dir, "tiny", "cpu"))


@pytest.fixture(scope="module")
def pair() -> tuple[LoRATrainer, LoRATrainer]:
    model_dir = model_dir_for_tests()
    fp32, bf16 = _trainer(model_dir, "fp32"), _trainer(model_dir, "bf16")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # a non-zero adapter (so lora_A has gradient and the KL is live),
        for name, p in fp32.named_trainable():  # the very same values on both sides
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        theirs = dict(bf16.named_trainable())
        for name, p in fp32.named_trainable():
            theirs[name].copy_(p)
    return fp32, bf16


def _samples(trainer: LoRATrainer) -> list[Sample]:
    """Two prompts sharing 40 tokens, three completions each; old log-probs near the
    current ones (ratios ≠ 1, a few clipped)."""
    g = torch.Generator().manual_seed(3)
    root = torch.randint(100, 40000, (40,), generator=g).tolist()
    drafts = []
    for _ in range(2):
        prompt = root + torch.randint(100, 40000, (12,), generator=g).tolist()
        for adv in (1.0, -0.5, -0.5):
            n = int(torch.randint(3, 12, (1,), generator=g))
            drafts.append(Sample(prompt, torch.randint(100, 40000, (n,), generator=g).tolist(),
                                 [0.0] * n, adv, 1.0))
    with torch.no_grad():
        logp = trainer._logps(_batch(drafts, trainer.pad_id), 1.0)
    return [Sample(s.prompt_ids, s.completion_ids,
                   (logp[i, -len(s.completion_ids):]
                    + 0.3 * torch.randn(len(s.completion_ids), generator=g)).tolist(),
                   s.advantage, 1.0) for i, s in enumerate(drafts)]


def test_bf16_keeps_what_accumulates_in_fp32(pair: tuple[LoRATrainer, LoRATrainer]) -> None:
    fp32, bf16 = pair
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    base = bf16.model.get_base_model()
    assert isinstance(base.get_output_embeddings(), Fp32Head)
    assert base.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in bf16.trainable())
    # The fp32 side is the model as loaded: no head swapped, nothing cast.
    assert not isinstance(fp32.model.get_base_model().get_output_embeddings(), Fp32Head)


def test_bf16_gradient_matches_fp32(pair: tuple[LoRATrainer, LoRATrainer]) -> None:
    fp32, bf16 = pair
    samples = _samples(fp32)
    for t in pair:
        t.model.train()
        t.optimizer.zero_grad(set_to_none=True)
    want, got = fp32.backward(samples), bf16.backward(samples)
    assert abs(got["loss"] - want["loss"]) <= LOSS_TOL, (got["loss"], want["loss"])
    assert 0 < want["clip_frac"] < 1  # the clip is exercised on both sides
    errors = {}
    for (name, a), b in zip(fp32.named_trainable(), bf16.trainable(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        assert b.grad.dtype == torch.float32
        errors[name] = float((a.grad - b.grad).norm() / a.grad.norm().clamp(min=1e-12))
    assert max(errors.values()) <= GRAD_TOL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    saved = [p.detach().clone() for p in bf16.trainable()]
    bf16.optimizer.step()
    moments = bf16.optimizer.state_dict()["state"]
    assert moments and all(s["exp_avg"].dtype == torch.float32 for s in moments.values())
    with torch.no_grad():  # the pair stays equal for the next test
        for p, old in zip(bf16.trainable(), saved, strict=True):
            p.copy_(old)
    for t in pair:
        t.optimizer.zero_grad(set_to_none=True)


def test_bf16_log_probs_match_fp32(pair: tuple[LoRATrainer, LoRATrainer]) -> None:
    fp32, bf16 = pair
    samples = _samples(fp32)
    b = _batch(samples, fp32.pad_id)
    with torch.no_grad():
        want, got = fp32._logps(b, 1.0), bf16._logps(b, 1.0)
    assert got.dtype == torch.float32
    gap = float(((want - got).abs() * b["mask"]).max())
    assert gap <= LOGP_TOL, gap


def test_micro_batch_is_the_setting_else_4_on_the_cpu(pair: tuple[LoRATrainer, LoRATrainer]
                                                      ) -> None:
    fp32, _ = pair
    assert fp32.micro_rows(430, 64) == 3
    auto = _trainer(model_dir_for_tests(), "auto", micro_batch=None)
    assert auto.dtype == torch.float32  # auto on the CPU: the path as it was
    assert auto.micro_rows(430, 64) == 4


def test_gradient_checkpointing_gives_the_same_gradient(
        pair: tuple[LoRATrainer, LoRATrainer]) -> None:
    """Checkpointed layers run every sequence in full (they drop the cache the prompt cut
    needs): the same GRPO gradient as the shared-prompt path, to fp32 rounding."""
    fp32, _ = pair
    model_dir = model_dir_for_tests()
    torch.manual_seed(1)
    ckpt = LoRATrainer(model_dir, lora=LoRASpec(r=4, alpha=8), grpo=GRPOConfig(kl_coef=0.05),
                       lr=1e-3, micro_batch=3, device="cpu", precision="fp32",
                       gradient_checkpointing=True,
                       base_model=build_model(model_dir, "tiny", "cpu"))
    with torch.no_grad():
        theirs = dict(ckpt.named_trainable())
        for name, p in fp32.named_trainable():
            theirs[name].copy_(p)
    samples = _samples(fp32)
    for t in (fp32, ckpt):
        t.model.train()
        t.optimizer.zero_grad(set_to_none=True)
    want, got = fp32.backward(samples), ckpt.backward(samples)
    assert abs(got["loss"] - want["loss"]) <= 1e-5
    for (name, a), b in zip(fp32.named_trainable(), ckpt.trainable(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        assert float((a.grad - b.grad).norm() / a.grad.norm()) <= 1e-4, name
    fp32.optimizer.zero_grad(set_to_none=True)


def test_cpu_micro_batches_shrink_where_memory_is_short(
        pair: tuple[LoRATrainer, LoRATrainer], monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset on the CPU: 4, or fewer when half of the memory available would not hold 4
    rows — a multi-turn demonstration keeps every token after the shared prefix (~1.6 MB a
    token for SmolLM2-135M), so 4 rows of 800 tokens need ~5 GB."""
    from flywheel.policy.memory import train_rows
    from flywheel.trainer import engine

    auto = _trainer(model_dir_for_tests(), "auto", micro_batch=None)
    monkeypatch.setattr(engine, "available_bytes", lambda: 64 * 2**30)
    assert auto.micro_rows(1000, 800) == 4
    # Just enough for 2 rows of an 800-token conversation after a 1,000-token prefix.
    two = 2.0**20
    while train_rows(two * 0.5, auto.shape, prompt_tokens=1000, completion_tokens=800,
                     dtype_bytes=4) < 2:
        two *= 1.1
    monkeypatch.setattr(engine, "available_bytes", lambda: int(two))
    assert auto.micro_rows(1000, 800) == 2      # a conversation after the prefix
    assert auto.micro_rows(1000, 40) == 4       # a short reply after it
    monkeypatch.setattr(engine, "available_bytes", lambda: None)
    assert auto.micro_rows(1000, 800) == 4      # memory unknown: as before
