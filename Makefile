# The README's two commands: `make run` (setup + default job) and `make test` (setup + full suite).
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run test lint format test-vllm
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

run: setup
	$(BIN)/molt train

test: setup lint
	$(BIN)/pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Opt-in (not part of `make test`): vLLM in its own .venv-vllm, then the vLLM adapter's test.
test-vllm:
	bash scripts/setup_vllm.sh
	MOLT_TEST_VLLM=1 $${VLLM_VENV:-.venv-vllm}/bin/pytest -q -s tests/engine/test_vllm.py
