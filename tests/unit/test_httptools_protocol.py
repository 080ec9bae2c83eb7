"""``app/http_protocol/httptools_protocol.py``: a response's head leaves with small first body bytes, in one
write; an upload's body is read into buffers that are handed to the app.

uvicorn's own protocol class (subclassed by the project) is fed raw requests over a
transport that records every write, with small ASGI apps answering; what reached the
transport, and in how many writes, is compared. (Every e2e test then checks the bytes
a real client receives through it.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from app.http_protocol.httptools_protocol import (
    BODY_BUFFER_BYTES,
    WITH_HEAD_BYTES,
    ECHttpToolsProtocol,
)
from testkit.polling import async_wait_for

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class RecordingTransport(asyncio.Transport):
    """What the protocol wrote, one entry per write call (``writelines`` joined); reads
    (``deliver``) go to the protocol set last, as a socket transport's do."""

    def __init__(self) -> None:
        super().__init__()
        self.protocol: asyncio.BaseProtocol | None = None
        self.buffers_offered: list[int] = []
        self.buffered_reads: list[int] = []
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.writes.append(b"".join(bytes(data) for data in list_of_data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self.protocol is not None
        return self.protocol

    def deliver(self, data: bytes) -> None:
        """``data`` arrives: a buffered protocol takes what fits in the buffer it
        offers, and the protocol then set takes the rest."""
        while data:
            protocol = self.protocol
            if isinstance(protocol, asyncio.BufferedProtocol):
                buffer = memoryview(protocol.get_buffer(-1))
                self.buffers_offered.append(len(buffer))
                n = min(len(buffer), len(data))
                buffer[:n] = data[:n]
                data = data[n:]
                self.buffered_reads.append(n)
                protocol.buffer_updated(n)
            else:
                assert isinstance(protocol, asyncio.Protocol)
                protocol.data_received(data)
                data = b""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def app_answering(body: bytes = b"hello", *, pause: bool = False) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if pause:  # the behaviour under test: the app awaits between head and body
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": body})

    return app


def head(length: int = 5) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % length


def start(app: Any) -> tuple[ECHttpToolsProtocol, RecordingTransport]:
    config = Config(app=app, access_log=False, server_header=False, date_header=False)
    config.load()
    protocol = ECHttpToolsProtocol(config, ServerState(), {}, asyncio.get_running_loop())
    transport = RecordingTransport()
    transport.set_protocol(protocol)
    protocol.connection_made(transport)
    return protocol, transport


def answered(
    transport: RecordingTransport, count: int, last_body: bytes, status: bytes = b"200 OK"
) -> bool:
    """Whether ``count`` answers of ``status`` were written, the last one's body too."""
    written = b"".join(transport.writes)
    return written.count(b"HTTP/1.1 " + status) >= count and written.endswith(last_body)


async def serve(app: Any, request: bytes) -> RecordingTransport:
    protocol, transport = start(app)
    transport.deliver(request)
    await async_wait_for(
        lambda: protocol.cycle is not None and protocol.cycle.response_complete,
        "the response to complete",
    )
    await asyncio.sleep(0)  # the cycle's task ends (a keep-alive connection goes idle)
    protocol.connection_lost(None)
    return transport


async def test_the_head_leaves_with_small_first_body_bytes() -> None:
    transport = await serve(app_answering(), b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
    assert transport.writes == [head() + b"hello"]
    # Also when the app awaits something between the head and the body.
    transport = await serve(app_answering(pause=True), b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
    assert transport.writes == [head() + b"hello"]


async def test_a_large_body_follows_a_head_of_its_own() -> None:
    body = bytes(WITH_HEAD_BYTES + 1)
    transport = await serve(app_answering(body), b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
    assert transport.writes == [head(len(body)), body]


async def test_a_response_without_body_bytes_sends_its_head_at_its_end() -> None:
    transport = await serve(app_answering(), b"HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n")
    assert transport.writes == [head()]
    transport = await serve(app_answering(b""), b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
    assert transport.writes == [head(0)]


async def test_a_closing_response_sends_its_head_first() -> None:
    request = b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    transport = await serve(app_answering(), request)
    closing_head = head().replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
    assert b"".join(transport.writes) == closing_head + b"hello"
    assert transport.closed


async def test_a_put_is_written_as_uvicorn_writes_it() -> None:
    """PUTs keep uvicorn's writes (``app.http_protocol.guarded`` wraps their transport)."""
    request = b"PUT /x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n"
    transport = await serve(app_answering(), request)
    assert transport.writes == [head(), b"hello"]


def recording_upload_app(received: list[Any]) -> Any:
    """Reads the whole body, keeping each ``http.request`` message of a PUT, then
    answers with the request's method."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        more = True
        while more:
            message = await receive()
            if scope["method"] == "PUT":
                received.append(message)
            more = message.get("more_body", False)
            # The behaviour under test: a busy app, pieces that arrive meanwhile wait.
            await asyncio.sleep(0.001)
        headers = [(b"content-length", b"%d" % len(scope["method"]))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": scope["method"].encode()})

    return app


def app_took_the_body(protocol: ECHttpToolsProtocol) -> bool:
    """Whether the app holds every body byte that arrived (none waits in the cycle)."""
    cycle = protocol.cycle
    if cycle is None or cycle.response_complete:
        return True
    return not getattr(cycle, "pieces", None) and not cycle.body


async def feed(
    protocol: ECHttpToolsProtocol, transport: RecordingTransport, pieces: list[bytes]
) -> None:
    """Each piece as it arrives from the socket, once the app has taken the last one."""
    for piece in pieces:
        transport.deliver(piece)
        await async_wait_for(lambda: app_took_the_body(protocol), "the app to take the body")


async def test_an_upload_body_is_read_into_buffers_handed_to_the_app() -> None:
    """A ``Content-Length`` PUT body: what comes with the head goes through the parser;
    the rest is read into the reader's buffers (up to ``BODY_BUFFER_BYTES``, never past
    the body's end) and the app gets views of them, no copies. The request pipelined
    behind the body's last bytes stays for the HTTP protocol, whose fresh parser
    reads it, and is answered on the same connection."""
    received: list[Any] = []
    protocol, transport = start(recording_upload_app(received))
    body_pieces = [bytes([n]) * (400_000 + n) for n in range(1, 5)]
    length = 2 + sum(len(piece) for piece in body_pieces)
    head_and_start = b"PUT /x HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % length
    await feed(protocol, transport, [head_and_start + b"ab", *body_pieces[:-1]])
    # The body's last bytes and the next request arrive together.
    await feed(protocol, transport, [body_pieces[-1] + b"GET /y HTTP/1.1\r\nHost: a\r\n\r\n"])
    await async_wait_for(lambda: answered(transport, 2, b"GET"), "both requests to be answered")
    protocol.connection_lost(None)

    assert received[0]["body"] == b"ab"  # came with the head: through the parser
    handed = [m["body"] for m in received[1:]]
    assert all(isinstance(piece, memoryview) for piece in handed), "copied, not handed over"
    assert b"".join(handed) == b"".join(body_pieces)
    assert [m["more_body"] for m in received] == [True] * (len(received) - 1) + [False]
    assert max(transport.buffers_offered) == BODY_BUFFER_BYTES
    assert sum(transport.buffered_reads) == length - 2  # not one byte of the GET
    assert b"".join(transport.writes).count(b"HTTP/1.1 200 OK") == 2
    assert b"".join(transport.writes).endswith(b"GET")


async def test_a_body_after_100_continue_is_read_into_buffers_from_its_second_read() -> None:
    """``Expect: 100-continue``: the head comes alone and the socket is idle until the
    app asks for the body; its first read comes as the socket's bytes, the rest into
    the reader's buffers (see ``ECHttpToolsProtocol.data_received``)."""
    received: list[Any] = []
    protocol, transport = start(recording_upload_app(received))
    pieces = [bytes([n]) * 300_000 for n in range(1, 4)]
    head = b"PUT /x HTTP/1.1\r\nHost: a\r\nContent-Length: 900000\r\nExpect: 100-continue\r\n\r\n"
    await feed(protocol, transport, [head])
    await async_wait_for(lambda: transport.writes, "the app to ask for the body")
    assert transport.protocol is protocol  # nothing of the body yet
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    await feed(protocol, transport, pieces)
    await async_wait_for(lambda: answered(transport, 1, b"PUT"), "the PUT to be answered")
    protocol.connection_lost(None)
    assert [bytes(m["body"]) for m in received] == pieces
    assert type(received[0]["body"]) is bytes
    assert sum(transport.buffered_reads) == 600_000
    assert b"".join(transport.writes).endswith(b"PUT")


async def test_pieces_that_arrive_while_the_app_is_busy_are_handed_over_in_order() -> None:
    """One message per piece, never joined (a copy)."""
    received: list[Any] = []
    protocol, transport = start(recording_upload_app(received))
    pieces = [bytes([n]) * 1000 for n in range(20)]
    transport.deliver(b"PUT /x HTTP/1.1\r\nHost: a\r\nContent-Length: 20000\r\n\r\n")
    for piece in pieces:  # all in before the app runs again
        transport.deliver(piece)
    await async_wait_for(lambda: answered(transport, 1, b"PUT"), "the PUT to be answered")
    protocol.connection_lost(None)
    assert [bytes(m["body"]) for m in received] == pieces
    assert [m["more_body"] for m in received] == [True] * 19 + [False]
    assert b"".join(transport.writes).endswith(b"PUT")


async def test_the_rest_of_a_body_answered_early_is_discarded() -> None:
    """An app that answers a PUT without reading its body (a refusal): the rest of
    the body goes back through the HTTP protocol, is counted off and dropped, and the
    request behind it is answered."""
    requests: list[str] = []

    async def refuse(scope: dict[str, Any], receive: Any, send: Any) -> None:
        requests.append(scope["method"])
        headers = [(b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 412, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    protocol, transport = start(refuse)
    await feed(
        protocol, transport, [b"PUT /x HTTP/1.1\r\nHost: a\r\nContent-Length: 300000\r\n\r\n"]
    )
    await feed(protocol, transport, [bytes(100_000), bytes(100_000)])
    await feed(protocol, transport, [bytes(100_000) + b"GET /y HTTP/1.1\r\nHost: a\r\n\r\n"])
    await async_wait_for(lambda: answered(transport, 2, b"", b"412 "), "both answered")
    protocol.connection_lost(None)
    assert requests == ["PUT", "GET"]
    assert b"".join(transport.writes).count(b"HTTP/1.1 412 ") == 2


async def test_a_chunked_upload_is_framed_by_the_parser() -> None:
    received: list[Any] = []
    protocol, transport = start(recording_upload_app(received))
    request = b"PUT /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = [b"5\r\nhello\r\n", b"6\r\n world\r\n", b"0\r\n\r\n"]
    await feed(protocol, transport, [request, *chunks, b"GET /y HTTP/1.1\r\nHost: a\r\n\r\n"])
    await async_wait_for(lambda: answered(transport, 2, b"GET"), "both requests to be answered")
    protocol.connection_lost(None)
    assert b"".join(m["body"] for m in received) == b"hello world"
    assert b"".join(transport.writes).count(b"HTTP/1.1 200 OK") == 2
