# One-command set-up: `make demo` runs the main job, `make test` passes the tests.
# Both create .venv, install the CPU torch wheel first (seconds where a local wheel exists; set
# TORCH_SPEC to choose another torch), then trainrec in editable mode with its dev extra.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR ?= demo_output

.PHONY: setup demo test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	rm -rf $(DEMO_DIR)
	MONITOR_OUTPUT_DIR=$(DEMO_DIR) $(PY) examples/plain_loop.py --steps 30
	$(VENV)/bin/trainrec inspect $(DEMO_DIR)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(DEMO_DIR) build *.egg-info
