"""The read path's GET on the event loop: S3's answer is read where it is consumed.

A read-through GET relays S3's body to its client as it arrives. Read through botocore's
transport (``signed_http``), each GET crosses to a pool thread and back, spends about 1 ms
of urllib3 and http.client Python, and every chunk wakes the loop from that thread. Here
the request is written and the answer read on the event loop itself: httptools (llhttp,
the parser uvicorn uses) parses its head, and the body is received straight into the
chunks the consumer gets, with no thread and no copy in between.

What it shares with the boto3 client: the SigV4 signature (``signing.Signer``), the
endpoint and TLS verification (``http_session.S3Transport``), the connect and read
timeouts, and ``EC_S3_MAX_POOL_CONNECTIONS`` as the number of idle connections kept
alive for reuse. It is the data plane's GET (``data_plane``) wherever no proxy stands
between the server and the endpoint; behind one, GETs go on botocore's transport
(``signed_http``) with the uploads.

Failures are those ``errors.map_error`` knows: ``ConnectionError`` (refused, reset,
closed early, TLS), ``TimeoutError`` (connect, or no byte for the read timeout), and
``ClientError`` for an error answer. Failed attempts are retried like ``signed_http``'s,
and a kept-alive connection that S3 closed before answering is replaced at once.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools
from botocore.config import Config

from app.retries import retried_async
from app.tiers.base import Chunk
from app.tiers.s3.botocore_adapter import get_cert_path
from app.tiers.s3.download import FIRST_READ_BYTES, OK, READ_AHEAD
from app.tiers.s3.errors import ERROR_BODY_BYTES, client_error, standard_retries
from app.tiers.s3.http_session import S3Transport
from app.tiers.s3.objects import ByteSpan
from app.tiers.s3.signing import Signer

#: The buffer an answer's head is received into (and parsed from).
HEAD_BUFFER_BYTES = 64 * 1024
#: Arrived bytes of a chunk handed to a waiting consumer before the chunk is full:
#: relayed at once, a chunk's tail would otherwise reach the client only after the
#: whole chunk (4 MiB: ~3 ms on loopback); fewer would cost a wake-up per socket read.
PIECE_BYTES = 512 * 1024


class _Connection(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection to S3, one exchange at a time.

    httptools parses each answer's head. The body of a 200 answer with a Content-Length
    (every S3 GET) then bypasses the parser: the socket is read straight into the
    chunk being filled, one copy from the kernel into the bytes the consumer gets
    (botocore's transport makes two). Other bodies (error documents) go through the
    parser into the same chunks. Chunks are ``want`` bytes, growing x8 up to ``most``;
    reading pauses while ``READ_AHEAD`` full chunks wait for the consumer.

    The consumer does not wait for a chunk to fill: it gets the first bytes of the body
    as soon as they arrive (a client waits for them), and later ones once
    ``PIECE_BYTES`` of a chunk arrived (a view, no copy), so S3's body is relayed as it
    arrives rather than one chunk later, the way nginx relays an upstream's. A consumer
    that fell behind takes everything that arrived meanwhile at once.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._head_buffer = memoryview(bytearray(HEAD_BUFFER_BYTES))
        self._into_chunk = False  # what get_buffer handed out
        self._waiter: asyncio.Future[None] | None = None
        self._last_activity = self._loop.time()
        self.closed = False
        self._start(0, 0)

    def _start(self, want: int, most: int) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.answered = False  # a byte of the answer arrived
        self.headers_done = False
        self.complete = False
        self._keep_alive = False
        self.error: BaseException | None = None
        self._body_left = -1  # bytes of a bypassing body still to come; -1: parsed
        self._chunk: bytearray | None = None
        self._filled = 0
        self._handed = 0  # bytes of the chunk handed over before it was full
        self._least_piece = 1  # until the first bytes are handed over; then PIECE_BYTES
        self._ready: deque[bytearray | memoryview] = deque()
        self._want = want
        self._most = most
        self._paused = False

    def send(self, request: bytes, want: int, most: int) -> None:
        """Write ``request``; its body will be handed over in chunks of ``want`` bytes,
        growing x8 up to ``most``."""
        assert self._transport is not None
        if self.closed or self._transport.is_closing():
            raise ConnectionError("S3 closed the connection")
        self._parser = httptools.HttpResponseParser(self)
        self._start(want, most)
        self._last_activity = self._loop.time()
        self._transport.write(request)

    @property
    def reusable(self) -> bool:
        return self.complete and not self.closed and self.error is None and self._keep_alive

    def close(self) -> None:
        # A loop already closed (a shutdown outside it) has dropped its transports.
        if self._transport is not None and not self.closed and not self._loop.is_closed():
            self._transport.abort()
        self.closed = True

    # -- asyncio.BufferedProtocol -----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def get_buffer(self, sizehint: int) -> memoryview:
        self._into_chunk = self._body_left > 0
        if not self._into_chunk:
            return self._head_buffer
        if self._chunk is None:
            self._new_chunk()
        assert self._chunk is not None
        return memoryview(self._chunk)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.answered = True
        self._last_activity = self._loop.time()
        if self._into_chunk:
            self._filled_by(nbytes)
        elif self.complete or self._body_left == 0:
            self._fail(ConnectionError("S3 sent more than its answer"))
            self.close()
        else:
            try:
                self._parser.feed_data(self._head_buffer[:nbytes])
            except (httptools.HttpParserError, ValueError) as exc:
                self._fail(ConnectionError(f"S3 sent a malformed HTTP answer: {exc}"))
                self.close()

    def eof_received(self) -> bool:
        self.closed = True  # not to be reused; connection_lost follows
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            reason = f": {exc}" if exc is not None else ""
            self._fail(ConnectionError(f"S3 closed the connection mid-answer{reason}"))
        self._wake()

    # -- httptools callbacks ----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        # Asked now: once the message is complete the parser has forgotten it.
        self._keep_alive = self._parser.should_keep_alive()
        self.headers_done = True
        length = self.headers.get("content-length")
        if self.status in OK and length is not None and "transfer-encoding" not in self.headers:
            self._body_left = int(length)  # ValueError: malformed (buffer_updated)
            if self._body_left == 0:
                self.complete = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        """Body bytes the parser saw: an error document, or the start of a bypassing
        body that came with the head."""
        view = memoryview(body)
        while view:
            if self._chunk is None:
                self._new_chunk()
            assert self._chunk is not None
            piece = view[: len(self._chunk) - self._filled]
            self._chunk[self._filled : self._filled + len(piece)] = piece
            view = view[len(piece) :]
            self._filled_by(len(piece))

    def on_message_complete(self) -> None:
        if self._body_left < 0:
            self._push()
            self.complete = True
            self._wake()

    # -- chunks -----------------------------------------------------------------------

    def _new_chunk(self) -> None:
        size = self._want if self._body_left < 0 else min(self._want, self._body_left)
        self._chunk = bytearray(size)
        self._filled = self._handed = 0
        self._want = min(self._want * 8, self._most)

    def _filled_by(self, count: int) -> None:
        assert self._chunk is not None
        self._filled += count
        if self._body_left > 0:
            self._body_left -= count
            if self._body_left == 0:
                self.complete = True
        if self._filled == len(self._chunk):
            self._push()
        elif self.complete or self._filled - self._handed >= self._least_piece:
            self._wake()

    def _push(self) -> None:
        """Queue the chunk being filled for the consumer: what arrived of it and was not
        handed over yet."""
        chunk, self._chunk = self._chunk, None
        if chunk is None or self._filled == self._handed:
            return
        whole = self._handed == 0 and self._filled == len(chunk)
        self._ready.append(chunk if whole else memoryview(chunk)[self._handed : self._filled])
        self._least_piece = PIECE_BYTES
        self._wake()
        if len(self._ready) >= READ_AHEAD and not self._paused:
            assert self._transport is not None
            self._transport.pause_reading()
            self._paused = True

    # -- waiting ----------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self, timeout: float) -> None:
        """Until the next wake-up; ``TimeoutError`` after ``timeout`` s without a byte
        from S3 (the socket-level read timeout botocore applies)."""
        while True:
            waiter = self._waiter = self._loop.create_future()
            try:
                async with asyncio.timeout_at(self._last_activity + timeout):
                    await waiter
                return
            except TimeoutError:
                if self._loop.time() - self._last_activity >= timeout:
                    raise TimeoutError(f"S3 sent nothing for {timeout:g} s") from None
            finally:
                self._waiter = None

    async def wait_headers(self, timeout: float) -> None:
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            await self._wait(timeout)

    def _piece(self) -> memoryview | None:
        """What arrived of the chunk being filled and was not handed over yet, if that
        is enough to hand over (see the class docstring)."""
        if self._chunk is None or self._filled - self._handed < self._least_piece:
            return None
        piece = memoryview(self._chunk)[self._handed : self._filled]
        self._handed = self._filled
        self._least_piece = PIECE_BYTES
        return piece

    async def read(self, timeout: float) -> Chunk:
        """The next chunk of the body, or part of it; ``b""`` at its end."""
        while not self._ready and self.error is None:
            if (piece := self._piece()) is not None:
                return piece
            if self.complete:
                return b""
            await self._wait(timeout)
        if self._ready:
            chunk = self._ready.popleft()
            if self._paused and len(self._ready) < READ_AHEAD:
                assert self._transport is not None
                self._transport.resume_reading()
                self._paused = False
                # The read timeout counts S3's silence, not the time it was paused.
                self._last_activity = self._loop.time()
            return chunk
        assert self.error is not None
        raise self.error


class LoopBody:
    """The body of a :class:`LoopGet`. Read to its end, its connection goes back to the
    pool; closed earlier, the connection is dropped instead of drained."""

    def __init__(self, get: LoopGet, connection: _Connection) -> None:
        self._get = get
        self._connection: _Connection | None = connection

    async def read(self) -> Chunk:
        """The next chunk; ``b""`` at the end of the body."""
        if self._connection is None:
            return b""
        data = await self._connection.read(self._get.read_timeout)
        if not data:
            await self.aclose()
        return data

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._get.release(connection)


class LoopGet:
    """GETs signed by ``signer``, sent to ``transport``'s endpoint with the timeouts and
    pool size of the boto3 client's ``config``, bodies handed over in chunks of up to
    ``chunk_size`` bytes. Its kept-alive connections belong to the event loop that
    opened them: use it from one loop (the server's)."""

    def __init__(
        self,
        transport: S3Transport,
        config: Config,
        signer: Signer,
        max_attempts: int,
        chunk_size: int,
    ) -> None:
        self._signer = signer
        self._endpoint = transport.endpoint
        self._retries = standard_retries(max_attempts)
        self._chunk_size = chunk_size
        self._connect_timeout: float = config.connect_timeout
        self.read_timeout: float = config.read_timeout
        self._max_idle: int = config.max_pool_connections
        parts = urlsplit(self._endpoint)
        https = parts.scheme == "https"
        self._address = (parts.hostname or "", parts.port or (443 if https else 80))
        self._ssl = _tls_context(transport.verify) if https else None
        self._idle: list[_Connection] = []

    async def open(
        self, key: str, span: ByteSpan | None = None, if_match: str | None = None
    ) -> tuple[Mapping[str, str], LoopBody]:
        """The response headers and the unread body of ``key`` (of its bytes ``span``
        when given, while its ETag is ``if_match`` when given). Raises ``ClientError``
        for an error answer (a missing object included), ``ConnectionError`` or
        ``TimeoutError`` after the last attempt."""
        return await retried_async(lambda: self._open_once(key, span, if_match), self._retries)

    async def _open_once(
        self, key: str, span: ByteSpan | None, if_match: str | None
    ) -> tuple[Mapping[str, str], LoopBody]:
        signed = self._signer.get(key, span, if_match)
        lines = [f"GET {signed.path} HTTP/1.1"]
        lines += [f"{name}: {value}" for name, value in signed.headers.items()]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        want = min(FIRST_READ_BYTES, self._chunk_size)
        connection = self._take_idle()
        reused = connection is not None
        if connection is None:
            connection = await self._connect()
        try:
            try:
                connection.send(request, want, self._chunk_size)
                await connection.wait_headers(self.read_timeout)
            except ConnectionError:
                if not reused or connection.answered:
                    raise
                # S3 closed the kept-alive connection before it answered: a new
                # connection, not a failed attempt (urllib3 does the same).
                connection.close()
                connection = await self._connect()
                connection.send(request, want, self._chunk_size)
                await connection.wait_headers(self.read_timeout)
            if connection.status in OK:
                return connection.headers, LoopBody(self, connection)
            document = bytearray()
            while len(document) < ERROR_BODY_BYTES:
                chunk = await connection.read(self.read_timeout)
                if not chunk:
                    break
                document += chunk
        except BaseException:
            connection.close()
            raise
        self.release(connection)
        raise client_error(connection.status, connection.headers, bytes(document), "GetObject")

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port = self._address
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, connection = await loop.create_connection(_Connection, host, port, ssl=self._ssl)
        except TimeoutError:
            raise TimeoutError(
                f"connecting to {self._endpoint} timed out after {self._connect_timeout:g} s"
            ) from None
        except OSError as exc:  # refused, unreachable, name not known, TLS verification
            raise ConnectionError(f"could not connect to {self._endpoint}: {exc}") from exc
        return connection

    def release(self, connection: _Connection) -> None:
        """Keep ``connection`` for the next GET if its exchange ended cleanly."""
        if connection.reusable and len(self._idle) < self._max_idle:
            self._idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        """Close the idle connections."""
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


def _tls_context(verify: bool | str | None) -> ssl.SSLContext:
    """TLS as botocore's transport does it: ``verify`` False trusts any certificate,
    True the default CA bundle, a path that bundle."""
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=get_cert_path(verify))
