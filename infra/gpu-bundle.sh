#!/usr/bin/env bash
# `make gpu-bundle`: the wheel folder a bare GPU machine (torch, transformers, peft, pytest; no
# network, none of Flywheel's other dependencies) installs Flywheel's GPU paths from, with
# `infra/gpu-check.sh --bundle`. Built here, on a machine with the package index:
#
#   BUNDLE/flywheel-*.whl   this tree (`pip wheel --no-deps .`)
#   BUNDLE/*.whl            what the trainer, the local engine, their tests and
#                           `flywheel bench gpu` import beyond torch/transformers/peft, at the
#                           versions requirements.lock pins, as binary wheels for
#                           GPU_PYTHON_VERSION on manylinux x86_64 (`pip download
#                           --only-binary=:all: --no-deps`: the list is the whole closure)
#   BUNDLE/model/           SmolLM2-135M's config.json and tokenizer (no weights): the
#                           tokenizer and the config the random-init shapes start from
#
# At most GPU_BUNDLE_MAX_MIB (60) in all. Env: PYTHON (default .venv/bin/python, which must
# have the default model: `make install`), GPU_BUNDLE (.gpu-bundle), GPU_PYTHON_VERSION (3.12).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
OUT=${GPU_BUNDLE:-.gpu-bundle}
PYV=${GPU_PYTHON_VERSION:-3.12}
MAX_MIB=${GPU_BUNDLE_MAX_MIB:-60}
# The import closure of flywheel.trainer, flywheel.policy.local, flywheel.bench.gpu and the
# GPU tests, less torch/transformers/peft and what they bring (numpy, safetensors, jinja2,
# tokenizers, huggingface-hub, pyyaml, …). tests/test_bundle_closure.py keeps it honest.
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions
          sqlalchemy greenlet jsonschema jsonschema-specifications referencing rpds-py attrs
          llguidance pytest-asyncio)

die() { echo "gpu-bundle: $*" >&2; exit 1; }
[ -x "$PY" ] || die "$PY not found: run \`make install\` first"

rm -rf "$OUT"
mkdir -p "$OUT/model"
"$PY" -m pip wheel -q --no-deps -w "$OUT" . >/dev/null

pins=()
for name in "${PACKAGES[@]}"; do
  pin=$(grep -iE "^${name}==[^ ]+" requirements.lock | head -1 | awk '{print $1}') \
    || die "$name is not in requirements.lock"
  [ -n "$pin" ] || die "$name is not in requirements.lock"
  pins+=("$pin")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 -d "$OUT" "${pins[@]}"

model=$("$PY" -c 'from flywheel.policy.model_cache import resolve_model_dir as r; print(r(None))')
for f in config.json generation_config.json tokenizer.json tokenizer_config.json \
         special_tokens_map.json chat_template.jinja; do
  [ -f "$model/$f" ] && cp "$model/$f" "$OUT/model/"
done
[ -f "$OUT/model/tokenizer.json" ] || die "no tokenizer in $model"

{ git rev-parse HEAD 2>/dev/null || echo unknown; git status --porcelain 2>/dev/null | grep -q . \
    && echo "(with uncommitted changes)"; } >"$OUT/COMMIT" || true
mib=$(du -sm "$OUT" | cut -f1)
[ "$mib" -le "$MAX_MIB" ] || die "$OUT is $mib MiB, over the $MAX_MIB MiB limit"
echo "gpu-bundle: $OUT ($mib MiB, Python $PYV): $(ls "$OUT" | grep -c '\.whl$') wheels + model/"
