"""Fixtures for tests against a real S3 endpoint (see ``testkit/s3.py``).

Default: a SeaweedFS ``weed mini`` per test session on free 127.0.0.1 ports. Set
``EC_TEST_S3_ENDPOINT_URL`` (+ ``EC_TEST_S3_BUCKET``, ``EC_TEST_S3_REGION``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``) to run the same tests against another
endpoint such as the MinIO of docker-compose; tests that stop the server then skip.
"""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings
from app.tiers.s3.client import S3Client
from app.tiers.s3.transfers import put_file
from testkit.fault_proxy import FaultProxy
from testkit.s3 import S3Endpoint, SeaweedFS, endpoint_from_env, seaweedfs_endpoint
from testkit.server import ServerProcess, settings_env

MiB = 1024 * 1024


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """The S3 endpoint of this test session, with its bucket present."""
    external = endpoint_from_env()
    if external is not None:
        external.ensure_bucket()
        yield external
        return
    with seaweedfs_endpoint(tmp_path_factory.mktemp("seaweedfs"), "ec-test") as endpoint:
        yield endpoint


class S3Control:
    """Stop and restart the managed S3 server mid-test (its data survives)."""

    def __init__(self, weed: SeaweedFS) -> None:
        self.weed = weed

    def stop(self) -> None:
        self.weed.stop()

    def kill(self) -> None:
        self.weed.kill()

    def start(self) -> None:
        self.weed.start()

    @property
    def running(self) -> bool:
        return self.weed.running


@pytest.fixture
def s3_control(s3_endpoint: S3Endpoint) -> Iterator[S3Control]:
    if s3_endpoint.managed is None:
        pytest.skip(
            "needs the managed SeaweedFS: cannot stop an external S3 endpoint "
            "(EC_TEST_S3_ENDPOINT_URL is set)"
        )
    control = S3Control(s3_endpoint.managed)
    try:
        yield control
    finally:
        if not control.running:  # leave the server up for the next test
            control.start()


@pytest.fixture
def s3_prefix(s3_endpoint: S3Endpoint) -> Iterator[str]:
    """A key prefix of this test's own; its objects are removed afterwards."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    yield prefix
    managed = s3_endpoint.managed
    if managed is None or managed.running:
        with contextlib.suppress(Exception):
            s3_endpoint.delete_prefix(prefix + "/")


@pytest.fixture
def s3_proxy(s3_endpoint: S3Endpoint) -> Iterator[FaultProxy]:
    """A proxy in front of the S3 endpoint that counts its requests and fails, holds
    or cuts them when told to."""
    if not s3_endpoint.endpoint_url.startswith("http://"):
        pytest.skip("the fault proxy forwards plain http:// endpoints only")
    with FaultProxy(s3_endpoint.endpoint_url) as proxy:
        yield proxy


def base_settings(endpoint: S3Endpoint, prefix: str) -> dict[str, Any]:
    """``Settings`` fields of a client on the test endpoint (small parts and chunks)."""
    return {
        "s3_bucket": endpoint.bucket,
        "s3_endpoint_url": endpoint.endpoint_url,
        "s3_prefix": prefix,
        "s3_region": endpoint.region,
        "s3_connect_timeout": 2.0,
        "s3_read_timeout": 20.0,
        "s3_max_attempts": 2,
        "s3_max_pool_connections": 8,
        "s3_multipart_threshold": 8 * MiB,
        "s3_multipart_part_size": 5 * MiB,
        "s3_multipart_concurrency": 3,
        "s3_get_chunk_size": 1 * MiB,
        "s3_unavailable_cooldown": 0.5,
    }


StoreFactory = Callable[..., S3Client]


@pytest.fixture
def make_store(s3_endpoint: S3Endpoint, s3_prefix: str) -> Iterator[StoreFactory]:
    """Build S3Clients on the test endpoint; ``make_store(s3_bucket=..., ...)`` overrides
    any :class:`~app.settings.Settings` field, ``access_key_id`` / ``secret_access_key``
    the test credentials. All are closed afterwards."""
    stores: list[S3Client] = []

    def factory(
        *,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        **overrides: Any,
    ) -> S3Client:
        settings = Settings(**{**base_settings(s3_endpoint, s3_prefix), **overrides})
        store = S3Client(
            settings,
            access_key_id=access_key_id or s3_endpoint.access_key,
            secret_access_key=secret_access_key or s3_endpoint.secret_key,
        )
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.shutdown()


@pytest.fixture
def tmp_file(tmp_path: Path) -> Callable[[bytes], Path]:
    counter = iter(range(1_000_000))

    def write(data: bytes) -> Path:
        path = tmp_path / f"body-{next(counter)}.bin"
        path.write_bytes(data)
        return path

    return write


ServerFactory = Callable[..., ServerProcess]


@pytest.fixture
def make_server(tmp_path: Path, s3_endpoint: S3Endpoint, s3_prefix: str) -> Iterator[ServerFactory]:
    """``make_server(name, endpoint_url=None, **EC_settings)``: a server on the test's S3
    prefix with its own data dir (``name`` picks it: same name = same dir)."""
    servers: list[ServerProcess] = []

    def factory(
        name: str = "a",
        *,
        endpoint_url: str | None = None,
        start: bool = True,
        env: dict[str, str] | None = None,
        **settings: str | int,
    ) -> ServerProcess:
        root = tmp_path / name
        root.mkdir(exist_ok=True)
        settings.setdefault("s3_unavailable_cooldown", "0.5")
        settings.setdefault("s3_connect_timeout", "2")
        settings.setdefault("s3_max_attempts", "2")
        settings.setdefault("writeback_retry_min", "0.2")
        settings.setdefault("writeback_retry_max", "1")
        settings.setdefault("log_level", "info")
        srv = ServerProcess(root / "data", root / "server.log")
        srv.env.update(s3_endpoint.env(endpoint_url, prefix=s3_prefix))
        srv.env.update(settings_env(settings))
        srv.env.update(env or {})
        servers.append(srv)
        return srv.start() if start else srv

    yield factory
    for srv in servers:
        srv.stop()


async def read_object(store: S3Client, key: str) -> bytes | None:
    """The whole object through ``store.open``, or None when it does not exist."""
    download = await store.open(key)
    if download is None:
        return None
    async with contextlib.aclosing(download):
        return b"".join([bytes(chunk) async for chunk in download.chunks()])


async def write_object(store: S3Client, key: str, data: bytes, *, crc32c: int) -> None:
    """Upload ``data`` as ``key`` as the server uploads an entry: from a file."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "body"
        path.write_bytes(data)
        await put_file(store, key, path, crc32c=crc32c)
