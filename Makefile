# Two commands for a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BACKENDS := jax tensorflow torch
PYTEST_ARGS ?=

.PHONY: demo test lint format clean

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[tensorflow,jax,torch,dev,examples,export]"
	touch $@

demo: $(BIN)/.installed
	KERAS_BACKEND=$${KERAS_BACKEND:-jax} $(BIN)/python examples/translate_numbers.py

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(BIN)/.installed
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# One process per backend: KERAS_BACKEND is read once, at import.
test: lint
	@failed=""; for backend in $(BACKENDS); do \
		echo "=== KERAS_BACKEND=$$backend"; \
		KERAS_BACKEND=$$backend $(BIN)/python -m pytest -q -p no:cacheprovider \
			--doctest-modules keras_attn tests $(PYTEST_ARGS) || failed="$$failed $$backend"; \
	done; \
	if [ -n "$$failed" ]; then echo "FAILED on:$$failed"; exit 1; fi; \
	echo "all backends passed: $(BACKENDS)"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
