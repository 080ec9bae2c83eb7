"""Failure paths inside a real engine: each time the engine stays up, recomputes what it
could not load, answers exactly as without a cache, and within the documented bounds.

The cache is filled once by a real engine; each test serves a copy of it through a
fault proxy (testkit/fault_proxy.py), so vLLM is told "present" and the
failure lands in the worker's load, after scheduling.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.fault_proxy import FaultProxy
from testkit.ports import free_port
from testkit.server import ServerProcess
from testkit.vllm_engine import connector_config
from tests.vllm_engine.conftest import (
    UNIQUE_IMAGES,
    EngineRun,
    assert_same_outputs,
    count,
    request_counts,
)

LOAD_TIMEOUT_S = 2.0
# Timeouts short enough for a test, as an operator would set them for a fast fallback.
FAST_FAILURE: dict[str, Any] = {
    "load_timeout_s": LOAD_TIMEOUT_S,
    "upload_timeout_s": 2,
    "save": False,
}


@pytest.fixture(scope="module")
def filled_data(run_engine: EngineRun, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A disk tier holding every image's entry, written by a real engine."""
    root = tmp_path_factory.mktemp("filled")
    with ServerProcess(root / "data", root / "server.log") as srv:
        run_engine(connector_config(srv.url))
        assert request_counts(srv.url).get(("entry", "PUT", "201")) == UNIQUE_IMAGES
    return root / "data"


@pytest.fixture
def filled_server(filled_data: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    shutil.copytree(filled_data, tmp_path / "data")
    with ServerProcess(tmp_path / "data", tmp_path / "server.log") as srv:
        yield srv


def assert_recomputed(run: dict[str, Any], baseline: dict[str, Any], bound_s: float) -> None:
    """Every image was encoded again, the outputs are the baseline's, nothing hung."""
    assert run["encoder_rows"] == baseline["encoder_rows"]
    assert_same_outputs(run, baseline)
    # A bound, not a benchmark: the baseline's own time plus what the docs allow.
    assert run["generate_seconds"] <= baseline["generate_seconds"] + bound_s


def test_server_down_from_the_start(run_engine: EngineRun, baseline: dict[str, Any]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    run = run_engine(connector_config(url, **FAST_FAILURE))
    # Refused connections cost a few existence requests, then the breaker answers "miss".
    assert_recomputed(run, baseline, bound_s=30)


@pytest.mark.parametrize("mode", ["kill", "503", "corrupt", "slow"])
def test_load_fails_after_scheduling(
    mode: str, run_engine: EngineRun, baseline: dict[str, Any], filled_server: ServerProcess
) -> None:
    """kill: the server dies between the scheduler's answer and the load; 503: its S3
    tier is down; corrupt: a body fails its CRC32C; slow: GETs stall past the deadline."""
    with FaultProxy(filled_server.url, mode, on_kill=filled_server.kill, delay_s=120) as proxy:
        run = run_engine(connector_config(proxy.url, **FAST_FAILURE))
        seen = dict(proxy.seen)
    assert seen.get("POST exists", 0) >= 1
    assert seen.get("GET entry", 0) >= 1  # the failure did happen in the load
    # Loads are retried until load_timeout_s, once per step that loads.
    assert_recomputed(run, baseline, bound_s=4 * LOAD_TIMEOUT_S + 30)
    if mode != "kill":
        counts = request_counts(filled_server.url)
        assert count(counts, "entry", "PUT") == 0  # save: false, nothing written
