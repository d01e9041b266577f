"""The trainer on a GPU (skipped without CUDA; run by infra/gpu-check.sh on a GPU machine):
the same GRPO gradient as on the CPU, an optimizer step, and a save/resume onto the GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flywheel.policy.model_cache import resolve_model_dir
from flywheel.trainer.engine import LoRASpec, LoRATrainer, Sample
from flywheel.trainer.grpo import GRPOConfig

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
    model_dir = resolve_model_dir(None)
    kw: dict[str, Any] = {"lora": LoRASpec(r=4), "grpo": GRPOConfig(kl_coef=0.05), "lr": 1e-3,
          "micro_batch": 2}
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
