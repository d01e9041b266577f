"""The trainer and the local engine on a GPU (skipped without CUDA; run by infra/gpu-check.sh on
a GPU machine, bare or not): in fp32 the same GRPO gradient as on the CPU, an optimizer step and
a save/resume onto the GPU; in bf16 (the GPU default) the gradient within the tolerance of
tests/test_trainer_precision.py and micro-batches sized by free memory; the engine in bf16 with
shared-prefix attention on, rows sized by free memory, its sampling log-probs those a fresh
forward gives. The model is `FLYWHEEL_TEST_MODEL_DIR` (a random-init SmolLM2-135M shape on a
bare machine) or the default model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flywheel.trainer.engine import LoRASpec, LoRATrainer, Sample
from flywheel.trainer.grpo import GRPOConfig
from tests.support.gpu_models import model_dir_for_tests

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _samples(seed: int) -> list[Sample]:
    """Two prompts sharing 24 tokens, three completions each, old log-probs off-policy."""
    g = torch.Generator().manual_seed(seed)
    root = torch.randint(100, 40000, (24,), generator=g).tolist()
    out = []
    for _ in range(2):
        prompt = root + torch.randint(100, 40000, (12,), generator=g).tolist()
        for adv in (1.0, -0.5, -0.5):
            n = int(torch.randint(1, 9, (1,), generator=g))
            out.append(Sample(prompt, torch.randint(100, 40000, (n,), generator=g).tolist(),
                              (-3.0 - torch.rand(n, generator=g)).tolist(), adv, 1.0))
    return out


def test_gpu_step_matches_cpu_and_resumes_on_the_gpu(tmp_path: Path) -> None:
    model_dir = model_dir_for_tests()
    kw: dict[str, Any] = {"lora": LoRASpec(r=4), "grpo": GRPOConfig(kl_coef=0.05), "lr": 1e-3,
          "micro_batch": 2, "precision": "fp32"}
    torch.manual_seed(0)
    cpu = LoRATrainer(model_dir, device="cpu", **kw)
    with torch.no_grad():  # a non-zero adapter, so lora_A has gradient and the KL is live
        for name, p in cpu.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    cpu.save(tmp_path / "start")
    gpu = LoRATrainer(model_dir, device="auto", resume_from=tmp_path / "start", **kw)
    assert gpu.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in gpu.trainable())
    samples = _samples(1)
    want, got = cpu.backward(samples), gpu.backward(samples)
    for k, v in want.items():
        assert abs(got[k] - v) <= 1e-3 * max(1.0, abs(v)), (k, got[k], v)
    for (name, a), b in zip(cpu.named_trainable(), gpu.trainable(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        err = float((a.grad - b.grad.cpu()).abs().max())
        assert err <= 1e-3 * max(float(a.grad.abs().max()), 1e-6), name
    gpu.optimizer.step()
    gpu.steps += 1
    gpu.save(tmp_path / "v1")
    resumed = LoRATrainer(model_dir, device="auto", resume_from=tmp_path / "v1", **kw)
    assert resumed.steps == 1
    for a, b in zip(gpu.trainable(), resumed.trainable(), strict=True):
        assert torch.equal(a.detach(), b.detach())
    moments = resumed.optimizer.state_dict()["state"]
    assert moments and all(s["exp_avg"].device.type == "cuda" for s in moments.values())


def test_bf16_on_the_gpu_matches_fp32_and_sizes_its_micro_batches(tmp_path: Path) -> None:
    from tests.support.gpu_models import GRAD_TOL, LOSS_TOL

    model_dir = model_dir_for_tests()
    kw: dict[str, Any] = {"lora": LoRASpec(r=4), "grpo": GRPOConfig(kl_coef=0.05), "lr": 1e-3,
          "micro_batch": 2}
    torch.manual_seed(0)
    ref = LoRATrainer(model_dir, device="cpu", precision="fp32", **kw)
    with torch.no_grad():
        for name, p in ref.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    ref.save(tmp_path / "start")
    gpu = LoRATrainer(model_dir, device="auto", resume_from=tmp_path / "start", **kw)
    assert gpu.dtype == torch.bfloat16  # the GPU default
    assert all(p.dtype == torch.float32 for p in gpu.trainable())
    samples = _samples(1)
    want, got = ref.backward(samples), gpu.backward(samples)
    assert abs(got["loss"] - want["loss"]) <= LOSS_TOL, (got["loss"], want["loss"])
    for (name, a), b in zip(ref.named_trainable(), gpu.trainable(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        err = float((a.grad - b.grad.cpu()).norm() / a.grad.norm().clamp(min=1e-12))
        assert err <= GRAD_TOL, (name, err)
    auto = LoRATrainer(model_dir, device="auto", **{**kw, "micro_batch": None})
    assert auto.micro_rows(430, 64) > 4  # free memory, not the CPU's 4


async def test_the_engine_in_bf16_on_the_gpu() -> None:
    from flywheel.policy.base import SamplingParams
    from flywheel.policy.local import LocalPolicy
    from flywheel.policy.logprobs import sequence_logprobs

    engine = LocalPolicy(model_dir_for_tests(), device="auto", precision="auto")
    try:
        assert engine.dtype == torch.bfloat16
        assert engine.prefix_attention  # the probe passes in bf16 now
        assert engine._row_limit(500) > 32  # rows from free memory, not the CPU's 32
        system = {"role": "system", "content": "You answer in one word. " * 40}
        groups = [await engine.sample([system, {"role": "user", "content": f"Question {i}"}],
                                      SamplingParams(n=8, max_tokens=16, seed=i))
                  for i in range(2)]
        for group in groups:
            for c in group:
                fresh = sequence_logprobs(engine.model, c.prompt_token_ids, c.token_ids, 1.0)
                gap = max(abs(a - b) for a, b in zip(c.logprobs, fresh, strict=True))
                assert gap <= 0.1, gap  # bf16 decoder, fp32 head; two orders of rounding
    finally:
        await engine.close()
