# a3b-triton: `make serve` and `make test` do everything on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= models/smollm2-135m-instruct

.PHONY: setup model serve test test-unit render check-render clean

setup:
	bash scripts/setup.sh

model: setup
	$(PY) -m a3b_backend.prepare_model --out $(MODEL_DIR)

render: setup
	$(PY) -m a3b_backend.repository

serve: setup model
	bash scripts/serve.sh

test: setup model
	$(PY) -m a3b_backend.repository --check
	$(PY) -m pytest -q tests

test-unit: setup model
	$(PY) -m pytest -q tests -m "not served"

clean:
	rm -rf $(VENV) models
