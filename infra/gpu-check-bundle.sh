#!/usr/bin/env bash
# infra/gpu-check.sh --bundle BUNDLE [--out OUT] [--cpu-dry-run]: see that script's header.
# Args: BUNDLE OUT DRY (1 = CPU dry run with tiny sizes). Env: PYTHON (default python3),
# BENCH_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."

BUNDLE=$1 OUT=$2 DRY=$3
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
fail=0
die() { echo "gpu-check: FAIL: $*" >&2; exit 1; }
step() { echo "gpu-check: $*"; }

[ -d "$BUNDLE" ] || die "no bundle at $BUNDLE: build it with \`make gpu-bundle\` on a networked machine"
if [ "$DRY" = 1 ]; then
  step "CPU dry run (tiny sizes; GPU tests skip)"
else
  command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
    || die "no NVIDIA GPU visible (nvidia-smi -L failed); --cpu-dry-run runs without one"
  "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
    || die "$PY's torch has no CUDA"
fi
"$PY" -c 'import sys, torch, transformers, peft, pytest
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "peft", peft.__version__, "pytest", pytest.__version__)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "free/total bytes", torch.cuda.mem_get_info())' \
  >"$OUT/env.txt" 2>&1 || die "torch, transformers, peft and pytest must be importable by $PY"
echo "bundle built from: $(cat "$BUNDLE/COMMIT" 2>/dev/null || echo unknown)" >>"$OUT/env.txt"
{ command -v nvidia-smi >/dev/null && nvidia-smi; } >>"$OUT/env.txt" 2>&1 || true
head -4 "$OUT/env.txt"

step "installing $BUNDLE into $PY (--no-index; wheels of packages already there are skipped)"
wheels=$("$PY" - "$BUNDLE" <<'EOF'
import importlib.metadata as md, pathlib, re, sys
for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower()
    try:
        md.version(name)
        if name != "flywheel":
            continue  # the machine's own copy wins (torch may need its typing-extensions)
    except md.PackageNotFoundError:
        pass
    print(w)
EOF
)
# shellcheck disable=SC2086
PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install -q --no-index --no-deps --force-reinstall \
  --find-links "$BUNDLE" $wheels || die "installing the bundle failed"
"$PY" -c 'import flywheel.trainer.engine, flywheel.policy.local, flywheel.bench.gpu' \
  || die "the bundle does not cover the GPU paths' imports"

if [ "$DRY" = 1 ]; then
  SHAPE=tiny
  BENCH=(--shapes tiny --device cpu --prompt-tokens 80 --shared-tokens 64 --max-tokens 8
         --levels 1,2 --generate-groups 2 --engine-timeout 120 --trainer-timeout 120
         --budget 300)
else
  SHAPE=smollm2-135m
  BENCH=(--shapes smollm2-135m,smollm2-1.7b)
fi
step "a random-init $SHAPE model for the tests (no weights can be brought here)"
"$PY" -m flywheel.bench.gpu --model-dir "$BUNDLE/model" --shapes "$SHAPE" \
  --write-model "$WORK/model" >/dev/null || die "could not write the test model"

step "GPU tests and the bf16 CPU tests (no Postgres, no Kafka)"
FLYWHEEL_TEST_MODEL_DIR="$WORK/model" "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/test_trainer_gpu.py tests/test_trainer_precision.py \
  tests/test_policy_prefix_attention.py tests/test_policy_memory.py tests/test_policy_kv.py 2>&1 \
  | tee "$OUT/pytest.txt" | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || { echo "gpu-check: FAIL: tests failed (see $OUT/pytest.txt)"; fail=1; }

step "flywheel bench gpu → $OUT/gpu-bench.json"
# shellcheck disable=SC2086
"$PY" -m flywheel.bench.gpu --model-dir "$BUNDLE/model" --out "$OUT/gpu-bench.json" \
  "${BENCH[@]}" ${BENCH_ARGS:-} >/dev/null 2>"$OUT/bench.err"
rc=$?
tail -5 "$OUT/bench.err"
[ "$rc" = 0 ] || { echo "gpu-check: FAIL: bench gpu exit $rc (partial figures kept)"; fail=1; }
rm -rf "$OUT/gpu-bench.parts" "$WORK"
[ "$fail" = 0 ] && step "PASS" || exit 1
