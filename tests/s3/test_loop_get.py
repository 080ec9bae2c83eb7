"""The read path's GET on the event loop (``app/tiers/s3/loop_get.py``): kept-alive
connections, bodies closed early, connections S3 closed, read timeouts, TLS, bodies relayed
as they arrive, and the switch to botocore's transport (``signed_http``) behind a proxy.
Against the real S3 endpoint where the behaviour is S3's, against a scripted server
where it is the network's."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import trustme

from app.checksum import crc32c as crc
from app.tiers.s3.errors import S3Unavailable
from app.tiers.s3.loop_get import PIECE_BYTES
from testkit.fault_proxy import FaultProxy
from tests.s3.conftest import MiB, StoreFactory, read_object, write_object

pytestmark = pytest.mark.anyio

#: What the scripted server does with one request: it gets the connection, writes the
#: answer (or not) and returns.
Script = Callable[[socket.socket], None]


class ScriptedServer:
    """A TCP server on 127.0.0.1 that answers every request with ``script`` (TLS with
    ``tls`` when given); one thread per connection, no keep-alive."""

    def __init__(self, script: Script, tls: ssl.SSLContext | None = None) -> None:
        self.script = script
        self._tls = tls
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._stopped = False
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        scheme = "https" if self._tls else "http"
        return f"{scheme}://127.0.0.1:{self._listener.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self._open.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
            head = b""
            while b"\r\n\r\n" not in head:
                data = sock.recv(65536)
                if not data:
                    return
                head += data
            self.script(sock)
        except OSError:
            pass
        finally:
            sock.close()

    def close(self) -> None:
        self._stopped = True
        self._listener.close()
        for sock in self._open:
            sock.close()


def answer_head(size: int) -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n".encode()


@pytest.fixture
def scripted() -> Iterator[Callable[..., ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def factory(script: Script, tls: ssl.SSLContext | None = None) -> ScriptedServer:
        servers.append(ScriptedServer(script, tls))
        return servers[-1]

    yield factory
    for server in servers:
        server.close()


async def test_connections_are_kept_alive_and_reused(
    make_store: StoreFactory, s3_proxy: FaultProxy
) -> None:
    writer = make_store()
    store = make_store(s3_endpoint_url=s3_proxy.url)
    objects = {f"{writer.prefix}/{n}.safetensors": bytes([n]) * (n * 300_000 + 1) for n in range(3)}
    for key, data in objects.items():
        await write_object(writer, key, data, crc32c=crc(data))
    for key, data in objects.items():
        assert await read_object(store, key) == data
    assert s3_proxy.count("GET") == 3
    assert s3_proxy.connections == 1


async def test_a_body_closed_early_drops_its_connection(
    make_store: StoreFactory, s3_proxy: FaultProxy
) -> None:
    writer = make_store()
    store = make_store(s3_endpoint_url=s3_proxy.url)
    key = f"{writer.prefix}/big.safetensors"
    data = bytes(range(256)) * (3 * MiB // 256)
    await write_object(writer, key, data, crc32c=crc(data))
    download = await store.open(key)
    assert download is not None
    async with contextlib.aclosing(download):
        first = await anext(download.chunks())
    assert data.startswith(first) and len(first) < len(data)
    # The rest of that body is not read into the next answer: a new connection serves it.
    assert await read_object(store, key) == data
    assert s3_proxy.connections == 2


async def test_a_kept_alive_connection_closed_by_s3_is_replaced(
    make_store: StoreFactory, s3_proxy: FaultProxy
) -> None:
    writer = make_store()
    # One attempt: the replaced connection must not count as a failed one.
    store = make_store(s3_endpoint_url=s3_proxy.url, s3_max_attempts=1)
    key = f"{writer.prefix}/again.safetensors"
    data = b"again" * 10_000
    await write_object(writer, key, data, crc32c=crc(data))
    assert await read_object(store, key) == data
    s3_proxy.down = True  # cuts the kept-alive connection
    s3_proxy.down = False
    assert await read_object(store, key) == data
    assert s3_proxy.connections == 2
    assert store.breaker.available


async def test_a_stalled_body_times_out_and_a_slow_one_does_not(
    make_store: StoreFactory, scripted: Callable[..., ScriptedServer]
) -> None:
    size = 100_000

    def stall(sock: socket.socket) -> None:
        sock.sendall(answer_head(size) + b"x" * 1000)
        time.sleep(3)  # the behaviour under test: a body that stalls

    def trickle(sock: socket.socket) -> None:
        sock.sendall(answer_head(size))
        for _ in range(10):  # the behaviour under test: 2 s in all, never 0.5 s idle
            time.sleep(0.2)
            sock.sendall(b"y" * (size // 10))

    server = scripted(stall)
    store = make_store(s3_endpoint_url=server.url, s3_read_timeout=0.5, s3_max_attempts=1)
    download = await store.open("stalled")
    assert download is not None and download.info.size == size
    started = time.monotonic()
    with pytest.raises(S3Unavailable, match=r"sent nothing for 0\.5 s"):
        async with contextlib.aclosing(download):
            async for _ in download.chunks():
                pass
    assert time.monotonic() - started < 2.5
    assert not store.breaker.available

    server.script = trickle
    store = make_store(s3_endpoint_url=server.url, s3_read_timeout=0.5, s3_max_attempts=1)
    assert await read_object(store, "trickled") == b"y" * size


async def test_tls_is_verified_as_boto3_verifies_it(
    make_store: StoreFactory, scripted: Callable[..., ScriptedServer]
) -> None:
    authority = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(server_tls)
    data = b"over TLS" * 5000

    def answer(sock: socket.socket) -> None:
        sock.sendall(answer_head(len(data)) + data)

    server = scripted(answer, tls=server_tls)
    trusting = make_store(s3_endpoint_url=server.url, s3_verify_tls=False)
    assert await read_object(trusting, "tls") == data
    # Verified against the default CA bundle, which does not know this test's authority.
    verifying = make_store(s3_endpoint_url=server.url, s3_max_attempts=1)
    with pytest.raises(S3Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
        await read_object(verifying, "tls")


async def test_behind_a_proxy_the_get_uses_botocores_transport(
    make_store: StoreFactory, s3_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = make_store()
    key = f"{writer.prefix}/proxied.safetensors"
    data = b"proxied" * 10_000
    await write_object(writer, key, data, crc32c=crc(data))
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", s3_proxy.url)
    store = make_store()
    assert store.data_plane.layer == "botocore"
    s3_proxy.reset()
    assert await read_object(store, key) == data
    assert s3_proxy.count("GET") == 1  # the front saw the GET, as a proxy


async def test_what_a_server_gets_wrong_about_the_framing(
    make_store: StoreFactory, scripted: Callable[..., ScriptedServer]
) -> None:
    data = bytes(range(256)) * 400

    def cut_short(sock: socket.socket) -> None:
        sock.sendall(answer_head(len(data)) + data[: len(data) // 2])

    def too_long(sock: socket.socket) -> None:
        sock.sendall(answer_head(len(data)) + data + b"trailing garbage")

    def missing_chunked(sock: socket.socket) -> None:
        document = (
            b"<?xml version='1.0'?><Error><Code>NoSuchKey</Code><Message>gone</Message></Error>"
        )
        sock.sendall(
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(document):x}\r\n".encode()
            + document
            + b"\r\n0\r\n\r\n"
        )

    server = scripted(cut_short)
    store = make_store(s3_endpoint_url=server.url, s3_max_attempts=1)
    with pytest.raises(S3Unavailable, match="closed the connection mid-answer"):
        await read_object(store, "cut")

    server.script = too_long  # the body is Content-Length bytes; the rest is not used
    store = make_store(s3_endpoint_url=server.url, s3_max_attempts=1)
    assert await read_object(store, "long") == data

    server.script = missing_chunked  # an error document in chunked encoding
    store = make_store(s3_endpoint_url=server.url, s3_max_attempts=1)
    assert await read_object(store, "missing") is None
    assert store.breaker.available


async def test_a_slow_consumer_is_not_a_silent_s3(make_store: StoreFactory) -> None:
    """Reading pauses while the consumer lags; that pause is not S3's silence."""
    store = make_store(s3_read_timeout=0.5, s3_get_chunk_size=64 * 1024, s3_max_attempts=1)
    key = f"{store.prefix}/slowly.safetensors"
    data = bytes(range(256)) * 4096
    await write_object(store, key, data, crc32c=crc(data))
    download = await store.open(key)
    assert download is not None
    received = bytearray()
    async with contextlib.aclosing(download):
        async for chunk in download.chunks():
            if not received:
                # The behaviour under test: a slow consumer; S3 fills the read-ahead,
                # then waits for us.
                await asyncio.sleep(0.8)
            received += chunk
    assert received == data


async def test_a_body_is_relayed_as_it_arrives_not_a_chunk_later(
    make_store: StoreFactory, scripted: Callable[..., ScriptedServer]
) -> None:
    """What arrived of a large chunk reaches the consumer while S3 is still sending it
    (all but less than ``PIECE_BYTES``, which waits for more)."""
    data = bytes(range(256)) * (3 * MiB // 256)
    sent_first = 2 * MiB  # the 64 KiB first chunk and most of the next, a 4 MiB one
    release = threading.Event()

    def pausing(sock: socket.socket) -> None:
        sock.sendall(answer_head(len(data)) + data[:sent_first])
        release.wait(10)
        sock.sendall(data[sent_first:])

    server = scripted(pausing)
    store = make_store(s3_endpoint_url=server.url, s3_get_chunk_size=4 * MiB, s3_max_attempts=1)
    download = await store.open("relayed")
    assert download is not None
    received = bytearray()
    async with contextlib.aclosing(download):
        chunks = download.chunks()
        while len(received) <= sent_first - PIECE_BYTES:
            received += await asyncio.wait_for(anext(chunks), 5)
        assert received == data[: len(received)]  # while S3 still holds back the rest
        release.set()
        async for chunk in chunks:
            received += chunk
    assert received == data
