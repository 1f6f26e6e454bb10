# splitstage: `make demo` runs the main job, `make test` runs the test suite (both set up .venv).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120

.PHONY: venv diffsynth-env test test-fast lint format demo bench stack-up stack-down clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The local CPU wheel first, so nothing downloads a CUDA build of torch.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# The diffsynth family's tests run in a side venv over .venv (docs/families/diffsynth.md).
SIDE := $(VENV)/diffsynth
SIDE_STAMP := $(SIDE)/.installed
$(SIDE_STAMP): $(STAMP) infra/diffsynth-env/make-env.sh infra/diffsynth-env/sitecustomize.py
	infra/diffsynth-env/make-env.sh $(SIDE) $(VENV)
	touch $(SIDE_STAMP)

diffsynth-env: $(SIDE_STAMP)

# Test files run on TEST_WORKERS processes (pytest-xdist; a file's tests stay on one worker, so
# its module fixtures are built once). Many tests start torchrun jobs of 2 ranks: more workers
# than cores only adds contention.
TEST_WORKERS ?= 2

test: $(STAMP) $(SIDE_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
	SPLITSTAGE_DIFFSYNTH_TESTS=1 $(SIDE)/bin/python -m pytest -q -p no:cacheprovider \
	  -n $(TEST_WORKERS) --dist loadfile tests/diffsynth

# The unit tests only (no servers, no torchrun): about 2-3 minutes here.
test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

demo: $(STAMP)
	$(PY) -m splitstage.demo

bench: $(STAMP)
	$(PY) bench/run_all.py

stack-up: $(STAMP)
	infra/stack.sh up

stack-down:
	infra/stack.sh down

clean:
	rm -rf runs .prefect .pytest_cache .ruff_cache .hypothesis
