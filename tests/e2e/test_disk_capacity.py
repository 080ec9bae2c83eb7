"""A body that cannot fit never evicts: against a server on a real 20 MiB tmpfs."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.entries import body
from testkit.polling import wait_for
from testkit.server import ServerProcess
from tests.e2e import rawhttp

MB = 1_000_000


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)]).returncode:
        pytest.fail(
            "this test needs root to mount a 20 MiB tmpfs (CI and dev machines run as root)"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _chunks(data: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_a_body_larger_than_the_file_system_evicts_nothing(small_fs: Path, tmp_path: Path) -> None:
    # The tier's own bound (1 GiB) is far above the file system's 20 MiB.
    with ServerProcess(
        small_fs / "d", tmp_path / "log", disk_max_bytes="1GiB", max_body_bytes="64MiB"
    ) as srv:
        entries = {f"e{i}": body((4 * MB,), "U8", 1, seed=i) for i in range(4)}
        for name, data in entries.items():
            assert httpx.put(f"{srv.url}/ec/m/uint8/{name}", content=data).status_code == 201

        def all_in_place() -> None:
            for name, data in entries.items():
                assert httpx.get(f"{srv.url}/ec/m/uint8/{name}").content == data, name
            assert list((small_fs / "d" / "tmp").iterdir()) == []

        huge = body((25 * MB,), "U8", 1, seed=9)
        # Declared length: refused before a byte of the body is read.
        declared = rawhttp.request(
            srv.port,
            "PUT",
            "/ec/m/uint8/huge",
            {"Content-Length": str(len(huge))},
            huge,
            send_body=False,
        )
        assert declared.status == 507
        assert declared.json()["error"] == "insufficient_storage"
        all_in_place()
        # Chunked (no length): refused once the safetensors header gives the length.
        chunked = httpx.put(f"{srv.url}/ec/m/uint8/huge", content=_chunks(huge), timeout=30)
        assert chunked.status_code == 507
        all_in_place()
        assert httpx.get(srv.url + "/stats").json()["disk"]["evictions"] == 0
        assert httpx.head(srv.url + "/ec/m/uint8/huge").status_code == 404

        # A body that fits once older entries go still evicts them, oldest first.
        fits = body((8 * MB,), "U8", 1, seed=8)
        assert httpx.put(srv.url + "/ec/m/uint8/fits", content=fits).status_code == 201
        assert httpx.get(srv.url + "/ec/m/uint8/fits").content == fits
        assert httpx.get(srv.url + "/ec/m/uint8/e0").status_code == 404
        assert httpx.get(srv.url + "/ec/m/uint8/e3").content == entries["e3"]


def test_concurrent_uploads_reserve_their_space(small_fs: Path, tmp_path: Path) -> None:
    with ServerProcess(
        small_fs / "d", tmp_path / "log", disk_max_bytes="1GiB", max_body_bytes="64MiB"
    ) as srv:
        first, second = body((12 * MB,), "U8", 1, seed=1), body((12 * MB,), "U8", 1, seed=2)
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        sock.sendall(
            f"PUT /ec/m/uint8/first HTTP/1.1\r\nHost: x\r\nContent-Length: {len(first)}\r\n\r\n".encode()
            + first[:MB]
        )
        # Wait until the first upload is in (its temp file exists): it holds 12 MB.
        wait_for(lambda: list((small_fs / "d" / "tmp").iterdir()), "the first upload", 5)
        # 12 + 12 MB cannot both fit in 20 MiB: the second is told to come back.
        refused = rawhttp.request(
            srv.port,
            "PUT",
            "/ec/m/uint8/second",
            {"Content-Length": str(len(second))},
            send_body=False,
        )
        assert refused.status == 503
        assert refused.headers["retry-after"] == "1"
        sock.sendall(first[MB:])
        assert rawhttp.read_response(sock).status == 201
        sock.close()
        # Once the first is stored, the second fits by evicting it.
        assert httpx.put(srv.url + "/ec/m/uint8/second", content=second).status_code == 201
        assert httpx.get(srv.url + "/ec/m/uint8/second").content == second
        assert list((small_fs / "d" / "tmp").iterdir()) == []
