"""Shared fixtures: a real ec-cache server process per test module or per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.server import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One disk-only server for a whole test module."""
    root = tmp_path_factory.mktemp("server")
    with ServerProcess(root / "data", root / "server.log", max_body_bytes="64MiB") as srv:
        yield srv


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        yield http


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server of its own for tests that restart, kill or fill it."""
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    yield srv
    srv.stop()
