"""Conditional PUTs against the real server: ``Expect: 100-continue`` and
``If-None-Match: *`` make a duplicate (412) or an oversized body (413) cost one request
head, and the SDK sends them by default."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import ec_cache
import pytest
import torch
from ec_cache import _backends

from testkit.server import ServerProcess

from .hostile import body_of, crc_of


def _key() -> str:
    return uuid.uuid4().hex


def _put_head(path: str, length: int, crc: str, *extra: str) -> bytes:
    lines = [
        f"PUT {path} HTTP/1.1",
        "Host: 127.0.0.1",
        f"Content-Length: {length}",
        "Content-Type: application/octet-stream",
        f"X-EC-CRC32C: {crc}",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _answer_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n\r\n", 1)[0]


def _connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def test_server_answers_a_duplicate_before_the_body(server: ServerProcess) -> None:
    """The raw exchange: a duplicate's ``412`` comes without ``100 Continue`` and
    without the server waiting for any body byte; a new key gets ``100 Continue``."""
    t = torch.randn(64, 64)
    body = body_of(t)
    key = _key()
    with ec_cache.Client(server.url, model="m", dtype="float32") as c:
        assert c.put(key, t) is True
    path = f"/ec/m/float32/{key}"
    conditional = ("Expect: 100-continue", "If-None-Match: *")
    with _connect(server) as sock:
        sock.sendall(_put_head(path, 67_000_000, crc_of(body), *conditional))
        head = _answer_head(sock)  # no body byte was sent
        assert head.startswith(b"HTTP/1.1 412 "), head
        assert b"connection: close" in head.lower()
    new = _key()
    with _connect(server) as sock:
        sock.sendall(_put_head(f"/ec/m/float32/{new}", len(body), crc_of(body), *conditional))
        assert _answer_head(sock).startswith(b"HTTP/1.1 100 ")
        sock.sendall(body)
        assert _answer_head(sock).startswith(b"HTTP/1.1 201 ")


@pytest.fixture()
def sent() -> Iterator[list[int]]:
    """Bytes the SDK writes to sockets (both clients), counted per test."""
    counts: list[int] = []
    sync_send, async_send = _backends.Socket.sendall, _backends.AsyncSocket.sendall

    def count_sync(self: Any, data: Any, timeout: Any) -> None:
        counts.append(len(data))
        sync_send(self, data, timeout)

    async def count_async(self: Any, data: Any, timeout: Any) -> None:
        counts.append(len(data))
        await async_send(self, data, timeout)

    _backends.Socket.sendall = count_sync  # type: ignore[method-assign]
    _backends.AsyncSocket.sendall = count_async  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        _backends.Socket.sendall = sync_send  # type: ignore[method-assign]
        _backends.AsyncSocket.sendall = async_send  # type: ignore[method-assign]


def test_duplicate_put_sends_no_body(
    server: ServerProcess, client_factory: Callable[..., Any], sent: list[int]
) -> None:
    t = torch.randn(1024, 1024)  # 4 MiB
    key = _key()
    c = client_factory(server.url, model="m", dtype="float32")
    assert c.put(key, t) is True
    first = sum(sent)
    assert first > t.nbytes
    sent.clear()
    assert c.put(key, t) is False  # 412: already there
    assert sum(sent) < 4096  # the request head only
    sent.clear()
    assert c.put(key, t, conditional=False) is False  # 200: the body went out
    assert sum(sent) > t.nbytes
    assert torch.equal(c.get(key), t)


def test_oversized_put_is_refused_before_the_body(
    make_server: Callable[..., ServerProcess], client_factory: Callable[..., Any], sent: list[int]
) -> None:
    srv = make_server(max_body_bytes="1MiB")
    c = client_factory(srv.url, model="m", dtype="float32")
    with pytest.raises(ec_cache.ServerError) as info:
        c.put(_key(), torch.zeros(1024, 1024))  # 4 MiB
    assert info.value.status_code == 413
    assert sum(sent) < 4096


def test_conditional_put_of_a_new_entry_round_trips(
    server: ServerProcess, client_factory: Callable[..., Any]
) -> None:
    c = client_factory(server.url, model="m", dtype="bfloat16")
    t = torch.randn(300, 70).to(torch.bfloat16)
    key = _key()
    assert c.put(key, t) is True
    assert torch.equal(c.get(key), t)
