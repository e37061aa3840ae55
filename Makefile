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

$(VENV)/.installed: pyproject.toml recorder/_fused.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

TRAINREC := $(VENV)/bin/trainrec

DEMO_THRESHOLD ?= 1

demo: setup
	rm -rf $(DEMO_DIR)
	MONITOR_OUTPUT_DIR=$(DEMO_DIR) $(PY) examples/plain_loop.py --steps 30
	$(TRAINREC) inspect $(DEMO_DIR)
	@echo
	@echo "The run is in $(DEMO_DIR)/ (its log and the reference's CSV files). Next, replay it:"
	@echo "  $(TRAINREC) check $(DEMO_DIR)                     # every frame verified"
	@echo "  $(TRAINREC) dump $(DEMO_DIR) --type se | head -3  # events as JSON lines"
	@echo "  $(TRAINREC) anomalies $(DEMO_DIR) --rule AnomalyTurbulence --threshold $(DEMO_THRESHOLD)   # re-detect"
	@echo "  $(TRAINREC) export tb $(DEMO_DIR) -o tb_out       # TensorBoard files"
	@echo "  $(TRAINREC) report $(DEMO_DIR) -o report.html     # one HTML page of the run"
	@echo "More: README.md (CLI at a glance) and docs/."

# Test files are spread over one worker per core (at most 4); each file stays on one worker, so
# the groups that a file's tests share are spawned once.
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 --dist loadfile

lint: setup
	$(VENV)/bin/ruff check .

MSPROBE_VENV := benchmarks/.venv-msprobe

# The reference (mindstudio-probe 1.2.1) in its own venv, for the side-by-side benchmarks.
$(MSPROBE_VENV)/.installed:
	$(PYTHON) -m venv $(MSPROBE_VENV)
	$(MSPROBE_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" mindstudio-probe==1.2.1
	touch $@

# Every benchmark, side by side with the reference; figures go to benchmarks/RESULTS.md by hand.
bench: setup $(MSPROBE_VENV)/.installed
	$(PY) benchmarks/bench_log.py --markdown
	$(PY) benchmarks/bench_stats.py --repeat 20
	$(PY) benchmarks/bench_recorder.py --steps 30 --warmup 3 --rounds 3
	$(PY) benchmarks/bench_dynamic.py --blocks 10 --steps 300
	$(PY) benchmarks/bench_anomalies.py --steps 1000 --tensors 2000
	$(PY) benchmarks/bench_export.py --steps 1000 --tensors 2000 --ref-steps 10
	$(PY) benchmarks/bench_csv_text.py
	$(PY) benchmarks/bench_live_resume.py --steps 2000 --tensors 500

clean:
	rm -rf $(VENV) $(DEMO_DIR) build *.egg-info
