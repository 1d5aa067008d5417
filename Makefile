# Lockstep: `make train` and `make test` each set everything up from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?= 2
# Three workers on the 2-core test machine: a worker often waits (a rank's rendezvous, a kill
# timed to the ledger, a watchdog's timeout), and the third keeps the cores busier: the same
# tests took 19m45s on 3 against 20m34s on 2, and 20m21s on 4 (docs/performance.md).
TEST_WORKERS ?= 3
TINY_DATA := datasets/stdlib/.complete
QWEN_TOKENIZER := datasets/tokenizers/qwen/manifest.json

.PHONY: setup train lint test test-fast test-bench test-xla data bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements-dev.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -q -c constraints.txt -r requirements-dev.txt
	touch $(STAMP)

$(TINY_DATA): $(STAMP)
	$(PY) -m data prepare

# The real Qwen vocabulary (the GPU presets' data.tokenizer); a few seconds, from an installed package.
$(QWEN_TOKENIZER): $(STAMP) data/templates/qwen2.5-instruct.jinja
	$(PY) -m data prepare --tokenizer qwen

data: $(TINY_DATA) $(QWEN_TOKENIZER)

train: $(STAMP) $(TINY_DATA) $(QWEN_TOKENIZER)
	$(PY) train.py --nproc $(NPROC) --config configs/tiny.yaml parallel.device=cpu $(ARGS)

# The linter (rules in pyproject.toml), run before the tests.
lint: $(STAMP)
	$(PY) -m ruff check .

# Tests run on TEST_WORKERS pytest workers (pytest-xdist) in groups: a file, or a guarantee-table
# row with its method's e2e file (tests/methods.py, worker_group), each group on one worker so
# that its shared reference runs are trained once, the groups longest first by their measured
# CPU seconds (tests/group_costs.py, tests/group_costs.json); TEST_WORKERS=0 runs them in this process.
XDIST := --dist loadgroup --no-loadscope-reorder

# The benchmark scripts' own CPU paths (tests/benchmarks) are a lane of their own, `make test-bench`,
# which .ci/run runs after `make test`: they check the measuring tools, not the training stack
# (about 195 worker-seconds of the suite, a minute of its wall time on the 2-core machine).
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(XDIST) --ignore=tests/benchmarks $(PYTEST_ARGS)

test-bench: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(XDIST) tests/benchmarks $(PYTEST_ARGS)

# The inner loop: the in-process tests only (no test marked `slow`, i.e. none that starts
# processes; tests/conftest.py), under 2 minutes on 2 cores from a cold cache. `make test` runs all the
# rest but tests/benchmarks (`make test-bench`).
test-fast: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(XDIST) -m "not slow" $(PYTEST_ARGS)

test-xla:
	bash scripts/setup_xla_venv.sh
	PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python -m pytest tests/xla -q

bench: $(STAMP) $(TINY_DATA)
	$(PY) -m data bench --config configs/tiny.yaml

clean:
	rm -rf $(VENV) runs datasets .pytest_cache
