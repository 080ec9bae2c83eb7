# ec-cache: the two commands a fresh clone needs are `make run` and `make test`.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
# torch 2.13.0 is the CPU build that lies on the build machines' disk; any other torch
# request can download a multi-GB CUDA build, so it is installed first and pinned.
TORCH  := torch==2.13.0

.PHONY: run test lint typecheck pytest-suite deploy-check bench clean

$(VENV)/.server: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test: pyproject.toml client/pyproject.toml $(VENV)/.server
	$(PIP) $(TORCH)
	$(PIP) -e '.[test]' -e './client[numpy]'
	touch $@

## run: start the server on its embedded default (disk only, data in ./ec-data)
run: $(VENV)/.server
	$(PY) -m app

## test: create the environments, lint, type-check and run the whole test suite
test: lint typecheck deploy-check pytest-suite

lint: $(VENV)/.test
	$(VENV)/bin/ruff check app client bench tests
	$(VENV)/bin/ruff format --check app client bench tests

typecheck: $(VENV)/.test
	$(VENV)/bin/mypy app client/ec_cache

# Server, SDK, S3 and end-to-end tests; tests/deploy runs under deploy-check with its tools.
pytest-suite: $(VENV)/.test
	$(PY) -m pytest tests --ignore=tests/deploy

## deploy-check: hadolint, compose config, helm lint/template, schema validation, tests/deploy
deploy-check:
	bash deploy/check.sh

## bench: the full benchmark run (see bench/README.md)
bench: $(VENV)/.test
	$(PY) -m bench.disk_get

clean:
	rm -rf $(VENV) .venv-* .pytest_cache .mypy_cache .ruff_cache
