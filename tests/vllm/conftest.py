"""Fixtures for the vLLM connector tests: a real ec-cache server process and vLLM
configs built the way ``vllm serve --ec-transfer-config '<json>'`` builds them.

Run with the dedicated environment (scripts/setup-vllm-venv.sh)::

    .venv-vllm/bin/python -m pytest tests/vllm

The server runs with the server's own interpreter (``testkit.server.server_python``:
``$EC_SERVER_PYTHON``, else ``<repo>/.venv/bin/python``).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from testkit.ports import free_port
from testkit.server import ServerProcess

if TYPE_CHECKING:
    from ec_cache.vllm import ECCacheConnector


class Server(ServerProcess):
    """A server process with the plain-HTTP helpers of these tests."""

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0)

    def stats(self) -> dict[str, Any]:
        with self.http() as c:
            r = c.get("/stats")
            r.raise_for_status()
            data: dict[str, Any] = r.json()
            return data


def start_server(tmp: Path, env_extra: dict[str, str] | None = None, port: int = 0) -> Server:
    srv = Server(tmp / "ec-data", tmp / "server.log", port=port)
    srv.env.update(env_extra or {})
    return srv.start()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One real server for the session; tests isolate themselves by model namespace."""
    srv = start_server(tmp_path_factory.mktemp("ec-server"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[Server]:
    """A server of the test's own (to kill it, or to count entries)."""
    srv = start_server(tmp_path)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A URL whose port accepts TCP connections (kernel backlog) but never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@pytest.fixture
def dead_url() -> str:
    """A URL where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


def cli_json(extra: dict[str, Any], role: str = "ec_both") -> str:
    """The ``--ec-transfer-config`` value documented in docs/vllm.md."""
    return json.dumps(
        {
            "ec_connector": "ECCacheConnector",
            "ec_role": role,
            "ec_connector_module_path": "ec_cache.vllm",
            "ec_connector_extra_config": extra,
        }
    )


@pytest.fixture
def make_vllm_config() -> Callable[..., Any]:
    """``VllmConfig`` on the CPU, without a model, with the EC transfer config parsed
    from its JSON exactly as vLLM's CLI parses ``--ec-transfer-config``."""
    from pydantic import TypeAdapter
    from vllm.config import DeviceConfig, ECTransferConfig, ParallelConfig, VllmConfig

    def make(
        extra: dict[str, Any],
        role: str = "ec_both",
        *,
        model_config: Any = None,
        tensor_parallel_size: int = 1,
        widths: dict[str, int] | None = None,
    ) -> Any:
        ec = TypeAdapter(ECTransferConfig).validate_json(cli_json(extra, role))
        # What vLLM measures at an EC producer's start (encoder output width per modality).
        ec.mm_encoder_output_widths = dict(widths or {})
        kwargs: dict[str, Any] = {
            "device_config": DeviceConfig(device="cpu"),
            "ec_transfer_config": ec,
        }
        if model_config is not None:
            kwargs["model_config"] = model_config
        if tensor_parallel_size != 1:
            kwargs["parallel_config"] = ParallelConfig(tensor_parallel_size=tensor_parallel_size)
        return VllmConfig(**kwargs)

    return make


@pytest.fixture
def connector(
    make_vllm_config: Callable[..., Any],
) -> Iterator[Callable[..., ECCacheConnector]]:
    """Build connectors through vLLM's factory; shut them all down afterwards."""
    from ec_cache.vllm import ECCacheConnector
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    made: list[ECCacheConnector] = []

    def make(
        role: ECConnectorRole, extra: dict[str, Any], ec_role: str = "ec_both", **kw: Any
    ) -> ECCacheConnector:
        config = make_vllm_config(extra, ec_role, **kw)
        conn = ECConnectorFactory.create_connector(config, role)
        assert isinstance(conn, ECCacheConnector)
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.shutdown()
