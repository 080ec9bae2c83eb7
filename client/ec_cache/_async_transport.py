"""The asyncio twin of :mod:`ec_cache._transport` for ``httpx.AsyncClient``.

Non-blocking sockets driven by ``loop.sock_sendall`` / ``loop.sock_recv_into``, so that
bodies go from and into caller memory without intermediate copies. ``asyncio`` only
(not trio), ``http://`` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import time
from collections.abc import AsyncIterator

import httpx

from . import _http11
from ._http11 import RECV_CHUNK, SEND_COALESCE, ConnBuffer, ResponseHead

__all__ = ["AsyncBody", "AsyncTransport"]

_Key = tuple[str, int]


async def _timed(aw: object, timeout: float | None) -> object:
    if timeout is None:
        return await aw  # type: ignore[misc]
    async with asyncio.timeout(timeout):
        return await aw  # type: ignore[misc]


class _Conn(ConnBuffer):
    def __init__(self, sock: socket.socket, key: _Key) -> None:
        super().__init__()
        self.sock = sock
        self.key = key
        self.last_used = time.monotonic()
        self.closed = False
        self.read_timeout: float | None = None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()

    def dropped(self) -> bool:
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))

    async def _recv_into(self, mv: memoryview) -> int:
        loop = asyncio.get_running_loop()
        try:  # fast path: data already there, no timer needed
            return self.sock.recv_into(mv)
        except BlockingIOError:
            pass
        if self.read_timeout is None:
            return await loop.sock_recv_into(self.sock, mv)
        async with asyncio.timeout(self.read_timeout):
            return await loop.sock_recv_into(self.sock, mv)

    async def fill(self) -> int:
        n = await self._recv_into(self._prepare_fill())
        if n:
            self.end += n
            self.received_any = True
        return n

    async def readinto(self, mv: memoryview) -> int:
        if self.start < self.end:
            return self._take(mv)
        if len(mv) > RECV_CHUNK:
            mv = mv[:RECV_CHUNK]
        n = await self._recv_into(mv)
        if n:
            self.received_any = True
        return n

    async def read_until(self, needle: bytes, limit: int) -> bytes:
        scanned = 0  # bytes after self.start already searched (survives compaction)
        while True:
            idx = self._find(needle, self.start + scanned)
            if idx >= 0:
                data = bytes(self.buf[self.start : idx + len(needle)])
                self.start = idx + len(needle)
                return data
            if self.pending > limit:
                raise ValueError("response head too large")
            scanned = self.pending
            if await self.fill() == 0:
                raise ConnectionResetError("server closed the connection")


class AsyncBody(httpx.AsyncByteStream):
    """Async body: ``await body.readinto(buffer)``; ``async for`` yields ``bytes``."""

    def __init__(
        self, transport: AsyncTransport, conn: _Conn, head: ResponseHead, request: httpx.Request
    ) -> None:
        self._transport = transport
        self._conn: _Conn | None = conn
        self._request = request
        self._keep_alive = head.keep_alive
        self._chunked = head.chunked
        self._remaining = head.content_length
        self._chunk_left = 0
        self.done = head.content_length == 0
        self.length = head.content_length
        if self.done:
            self._close_now()

    async def readinto(self, mv: memoryview) -> int:
        conn = self._conn
        if self.done or conn is None or len(mv) == 0:
            return 0
        try:
            if self._chunked:
                return await self._readinto_chunked(conn, mv)
            if self._remaining is None:
                n = await conn.readinto(mv)
                if n == 0:
                    self._keep_alive = False
                    self._finish()
                return n
            if len(mv) > self._remaining:
                mv = mv[: self._remaining]
            n = await conn.readinto(mv)
            if n == 0:
                raise httpx.RemoteProtocolError(
                    f"server closed the connection with {self._remaining} body bytes missing",
                    request=self._request,
                )
            self._remaining -= n
            if self._remaining == 0:
                self._finish()
            return n
        except TimeoutError:
            self._abort()
            raise httpx.ReadTimeout("timed out reading the body", request=self._request) from None
        except OSError as exc:
            self._abort()
            raise httpx.ReadError(f"reading the body: {exc}", request=self._request) from exc
        except BaseException:
            self._abort()
            raise

    async def _readinto_chunked(self, conn: _Conn, mv: memoryview) -> int:
        while self._chunk_left == 0:
            line = await conn.read_until(b"\r\n", 4096)
            if line == b"\r\n":
                continue
            size = _http11.parse_chunk_size(line, self._request)
            if size == 0:
                while await conn.read_until(b"\r\n", 16384) != b"\r\n":
                    pass
                self._finish()
                return 0
            self._chunk_left = size
        if len(mv) > self._chunk_left:
            mv = mv[: self._chunk_left]
        n = await conn.readinto(mv)
        if n == 0:
            raise httpx.RemoteProtocolError(
                "connection closed inside a chunk", request=self._request
            )
        self._chunk_left -= n
        return n

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunk = memoryview(bytearray(RECV_CHUNK))
        while True:
            n = await self.readinto(chunk)
            if n == 0:
                return
            yield bytes(chunk[:n])

    def _finish(self) -> None:
        self.done = True
        self._close_now()

    def _abort(self) -> None:
        self._keep_alive = False
        self.done = True
        self._close_now()

    def _close_now(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self.done and self._keep_alive and conn.pending == 0:
            self._transport._release(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self._close_now()


class AsyncTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncBaseTransport`` over non-blocking sockets, zero-copy bodies."""

    def __init__(self, *, max_keepalive: int = 16, keepalive_expiry: float = 4.0) -> None:
        self._max_keepalive = max_keepalive
        self._expiry = keepalive_expiry
        self._idle: dict[_Key, list[_Conn]] = {}
        self._closed = False

    async def _connect(self, key: _Key, timeout: float | None) -> _Conn:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(key[0], key[1], type=socket.SOCK_STREAM)
        last: OSError | None = None
        for family, type_, proto, _, addr in infos:
            sock = socket.socket(family, type_, proto)
            sock.setblocking(False)
            try:
                await _timed(loop.sock_connect(sock, addr), timeout)
            except BaseException as exc:
                sock.close()
                if isinstance(exc, OSError) and not isinstance(exc, TimeoutError):
                    last = exc
                    continue
                raise
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return _Conn(sock, key)
        raise last or OSError(f"no address for {key}")

    async def _acquire(self, key: _Key, connect_timeout: float | None) -> tuple[_Conn, bool]:
        now = time.monotonic()
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if now - conn.last_used > self._expiry or conn.dropped():
                conn.close()
                continue
            return conn, True
        return await self._connect(key, connect_timeout), False

    def _release(self, conn: _Conn) -> None:
        conn.last_used = time.monotonic()
        conn.received_any = False
        if not self._closed:
            idle = self._idle.setdefault(conn.key, [])
            if len(idle) < self._max_keepalive:
                idle.append(conn)
                return
        conn.close()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"AsyncTransport speaks http:// only, not {url.scheme}://", request=request
            )
        key = (url.host, url.port or 80)
        timeouts = request.extensions.get("timeout", {})
        head_bytes = _http11.request_head(request)
        for attempt in (0, 1):
            try:
                conn, reused = await self._acquire(key, timeouts.get("connect"))
            except TimeoutError:
                raise httpx.ConnectTimeout(f"connecting to {key}", request=request) from None
            except OSError as exc:
                raise httpx.ConnectError(f"connecting to {key}: {exc}", request=request) from exc
            phase = "write"
            try:
                await self._send(conn, head_bytes, request, timeouts.get("write"))
                phase = "read"
                conn.read_timeout = timeouts.get("read")
                head = await self._read_head(conn, request)
            except (OSError, ValueError) as exc:
                early = None
                if phase == "write" and not isinstance(exc, TimeoutError | ValueError):
                    early = await self._early_answer(conn, request, timeouts.get("read"))
                if early is not None:
                    return self._response(conn, early, request, keep_alive=False)
                conn.close()
                if isinstance(exc, TimeoutError):
                    kind = httpx.WriteTimeout if phase == "write" else httpx.ReadTimeout
                    raise kind(f"timed out ({phase})", request=request) from None
                if reused and attempt == 0 and not conn.received_any:
                    continue
                if isinstance(exc, ValueError):
                    raise httpx.RemoteProtocolError(str(exc), request=request) from exc
                kind2 = httpx.WriteError if phase == "write" else httpx.ReadError
                raise kind2(f"{phase}: {exc}", request=request) from exc
            except BaseException:
                conn.close()
                raise
            return self._response(conn, head, request, keep_alive=head.keep_alive)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _early_answer(
        self, conn: _Conn, request: httpx.Request, timeout: float | None
    ) -> ResponseHead | None:
        """After a failed write: the answer the server sent before closing, if any."""
        try:
            conn.read_timeout = timeout if timeout is not None else 5.0
            return await self._read_head(conn, request)
        except (OSError, ValueError, httpx.HTTPError):
            return None

    def _response(
        self, conn: _Conn, head: ResponseHead, request: httpx.Request, *, keep_alive: bool
    ) -> httpx.Response:
        head.keep_alive = keep_alive
        body = AsyncBody(self, conn, head, request)
        return httpx.Response(
            head.status,
            headers=head.headers,
            stream=body,
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": head.reason,
                "ec_body": body,
            },
        )

    @staticmethod
    async def _send(
        conn: _Conn, head: bytes, request: httpx.Request, timeout: float | None
    ) -> None:
        """Send head and body; ``timeout`` bounds each write (one body chunk)."""
        loop = asyncio.get_running_loop()
        sock = conn.sock
        pending = head
        stream = request.stream
        if not isinstance(stream, httpx.AsyncByteStream):
            raise TypeError("AsyncTransport needs an async request stream")
        async for chunk in stream:
            if len(chunk) < SEND_COALESCE:
                pending += chunk
                continue
            if pending:
                await _timed(loop.sock_sendall(sock, pending), timeout)
                pending = b""
            await _timed(loop.sock_sendall(sock, chunk), timeout)
        if pending:
            await _timed(loop.sock_sendall(sock, pending), timeout)

    @staticmethod
    async def _read_head(conn: _Conn, request: httpx.Request) -> ResponseHead:
        while True:
            data = await conn.read_until(b"\r\n\r\n", _http11.MAX_HEAD_BYTES)
            head = _http11.parse_response_head(data, request)
            if 100 <= head.status < 200 and head.status != 101:
                continue
            return head
