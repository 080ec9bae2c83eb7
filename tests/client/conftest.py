"""Fixtures for the SDK tests: real ec-cache servers (``python -m app``) on free ports."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "client"
if str(CLIENT_DIR) not in sys.path:  # the SDK may not be installed in the venv
    sys.path.insert(0, str(CLIENT_DIR))

import ec_cache  # noqa: E402

from testkit.server import ServerProcess, settings_env  # noqa: E402


def _server(root: Path, **settings: str) -> ServerProcess:
    """A server roomy enough for the 100+ MB round trips; ``settings`` as ``EC_*``
    names without the prefix."""
    root.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(root / "data", root / "server.log")
    server.env.update(settings_env({"disk_max_bytes": "2GiB", "max_body_bytes": "512MiB"}))
    server.env.update(settings_env(settings))
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with _server(tmp_path_factory.mktemp("ec-server")) as srv:
        yield srv


@pytest.fixture()
def make_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start extra servers for a test; all are stopped afterwards."""
    started: list[ServerProcess] = []

    def make(**settings: str) -> ServerProcess:
        srv = _server(tmp_path / f"server-{len(started)}", **settings)
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
