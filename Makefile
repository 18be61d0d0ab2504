# The two commands (see README): `make run` and `make test`. Both set up what they need.
VENV ?= .venv
BIN := $(VENV)/bin
PACKAGES := kaisa_ray kaisa_train tuner service

.PHONY: setup run test test-fast lint typecheck pytest bench

setup:
	@bash scripts/setup.sh

# The service with an embedded local Ray head, and the example job submitted to it.
run: setup
	$(BIN)/kaisa-ray serve --submit examples/fashion_mnist.yaml

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy --strict $(PACKAGES)

# Two workers (pytest-xdist): a test at a time to the free one, the Ray tests first; a module
# whose tests share a fixture of its own runs on one worker (tests/conftest.py says why).
PYTEST_WORKERS ?= 2

pytest: setup
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The inner loop: everything but Ray, real services and many processes (about 4 minutes).
test-fast: setup
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not slow and not ray"

test: lint typecheck pytest

bench: setup
	$(BIN)/python benchmarks/optimizers_fashion_mnist.py
	$(BIN)/python benchmarks/ray_time_to_accuracy.py
	$(BIN)/python benchmarks/tuner_oracle.py
