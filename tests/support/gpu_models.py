"""The model directory the GPU and precision tests build from: `FLYWHEEL_TEST_MODEL_DIR` (on a
bare GPU machine, infra/gpu-check.sh points it at a random-init SmolLM2-135M-shaped model, or
at the bundle's config + tokenizer), else the default model's cache directory."""

from __future__ import annotations

import os
from pathlib import Path

GRAD_TOL = 0.05
"""Largest relative L2 error of a LoRA gradient tensor, bf16 against fp32."""
LOSS_TOL = 0.02
"""Largest absolute difference of the GRPO loss, bf16 against fp32."""
LOGP_TOL = 0.01
"""Largest absolute difference of a completion token's log-prob, bf16 against fp32."""


def model_dir_for_tests() -> Path:
    env = os.environ.get("FLYWHEEL_TEST_MODEL_DIR")
    if env:
        return Path(env)
    from flywheel.policy.model_cache import resolve_model_dir

    return resolve_model_dir(None)


def has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
