"""Fixtures for the SDK tests: real ec-cache servers (``python -m app``) on free ports.

Self-contained on purpose (the SDK tests must not depend on the server's test helpers).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "client"
if str(CLIENT_DIR) not in sys.path:  # the SDK may not be installed in the venv
    sys.path.insert(0, str(CLIENT_DIR))

import ec_cache  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One ``python -m app`` subprocess with its own data directory."""

    def __init__(self, data_dir: Path, port: int | None = None, **env: str) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> ServerProcess:
        env = dict(
            os.environ,
            EC_HOST="127.0.0.1",
            EC_PORT=str(self.port),
            EC_DATA_DIR=str(self.data_dir),
            EC_DISK_MAX_BYTES="2GiB",
            EC_MAX_BODY_BYTES="512MiB",
            EC_LOG_LEVEL="warning",
            **self.env,
        )
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=log, stderr=log
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server on {self.url} not ready")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("ec-data")).start()
    yield srv
    srv.stop()


@pytest.fixture()
def make_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start extra servers for a test; all are stopped afterwards."""
    started: list[ServerProcess] = []

    def make(**env: str) -> ServerProcess:
        srv = ServerProcess(tmp_path / f"data-{len(started)}", None, **env)
        started.append(srv)
        return srv.start()

    yield make
    for srv in started:
        srv.stop()


class SyncFacade:
    """An ``AsyncClient`` driven from sync code, so every round-trip test runs against
    both clients with the same body."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = ec_cache.AsyncClient(*args, **kwargs)

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self._loop.run_until_complete(coro)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr) or not asyncio.iscoroutinefunction(attr):
            return attr
        return lambda *a, **k: self._run(attr(*a, **k))

    def close(self) -> None:
        self._run(self._client.aclose())
        self._loop.close()

    def __enter__(self) -> SyncFacade:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(params=["sync", "async"])
def client_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``factory(url, model=..., dtype=..., **kw)`` -> ``Client`` or the async facade."""
    made: list[Any] = []

    def factory(*args: Any, **kwargs: Any) -> Any:
        c = (
            ec_cache.Client(*args, **kwargs)
            if request.param == "sync"
            else SyncFacade(*args, **kwargs)
        )
        made.append(c)
        return c

    yield factory
    for c in made:
        c.close()
