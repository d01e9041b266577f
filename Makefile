# The two commands: `make demo` and `make test`. Both create .venv and install when needed.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

demo: install
	$(VENV)/bin/flywheel demo

test: install
	$(PY) -m ruff check flywheel consumers producers migrations tests
	$(PY) -m mypy
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/flywheel bench ingest --n 50000

clean:
	-$(VENV)/bin/flywheel down
	rm -rf .flywheel
