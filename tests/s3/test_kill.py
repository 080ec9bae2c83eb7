"""SIGKILL at awkward moments with the S3 tier: the tiers stay consistent."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx

from testkit.entries import body
from testkit.polling import wait_for
from testkit.s3 import S3Endpoint
from tests.s3.conftest import ServerFactory


def files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def test_kill_mid_get_read_through_leaves_no_partial_entry(make_server: ServerFactory) -> None:
    data = body((24 << 20,), "U8", 1, seed=7)
    writer = make_server("writer")
    assert httpx.put(f"{writer.url}/ec/m/uint8/big", content=data, timeout=120).status_code == 201

    reader = make_server("reader", s3_get_chunk_size="1MiB")
    sock = socket.create_connection(("127.0.0.1", reader.port), timeout=30)
    sock.sendall(b"GET /ec/m/uint8/big HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(65536)  # the read-through fill has started streaming
    reader.kill()
    sock.close()
    assert files(reader.data_dir / "objects") == []  # never committed half a body

    reader.start()
    assert files(reader.data_dir / "tmp") == []
    got = httpx.get(f"{reader.url}/ec/m/uint8/big", timeout=120)
    assert got.status_code == 200
    assert got.content == data
    wait_for(lambda: files(reader.data_dir / "objects"), "the fill to commit", timeout=10)
    assert len(files(reader.data_dir / "objects")) == 1


def test_kill_mid_write_through_put_stores_nothing_anywhere(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    srv = make_server("a")
    data = body((24 << 20,), "U8", 1, seed=8)
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    sock.sendall(
        f"PUT /ec/m/uint8/half HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode()
    )
    sock.sendall(data[: 12 << 20])
    wait_for(lambda: srv.uploads_in_flight() == 1, "the upload to be under way")
    srv.kill()
    sock.close()
    srv.start()
    assert httpx.get(f"{srv.url}/ec/m/uint8/half").status_code == 404
    assert files(srv.data_dir / "tmp") == []
    assert not [
        key for key in s3_endpoint.list_keys(s3_prefix + "/") if key.endswith("half.safetensors")
    ]
