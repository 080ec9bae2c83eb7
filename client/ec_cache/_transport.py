"""A small blocking HTTP/1.1 transport for ``httpx.Client`` that can receive a body
straight into caller memory.

httpx's own transport reads 64 KiB at a time and copies each piece several times on
its way to ``Response.content`` (measured: ~3x slower than the wire). This one keeps
httpx's API (requests, headers, timeouts, event hooks) but does the socket work itself:

* request bodies are sent from the caller's buffers (``memoryview`` s of tensor memory),
* ``response.extensions["ec_body"]`` is a :class:`SyncBody` whose ``readinto(buffer)``
  receives with ``recv_into`` directly into the caller's buffer,
* keep-alive connections are pooled per ``(host, port)``, checked for a server-side
  close before reuse, and a request whose reused connection turns out dead before any
  byte of the answer arrived is sent once more on a fresh connection.

``http://`` only; the clients use httpx's stock transport for ``https://``.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator

import httpx

from . import _http11
from ._http11 import RECV_CHUNK, SEND_COALESCE, ConnBuffer, ResponseHead

__all__ = ["SyncBody", "SyncTransport"]

_Key = tuple[str, int]


class _Conn(ConnBuffer):
    def __init__(self, sock: socket.socket, key: _Key) -> None:
        super().__init__()
        self.sock = sock
        self.key = key
        self.last_used = time.monotonic()
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()

    def dropped(self) -> bool:
        """True when the server closed (or sent something unexpected) while idle."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))

    def fill(self) -> int:
        room = self._prepare_fill()
        n = self.sock.recv_into(room)
        if n:
            self.end += n
            self.received_any = True
        return n

    def readinto(self, mv: memoryview) -> int:
        if self.start < self.end:
            return self._take(mv)
        if len(mv) > RECV_CHUNK:
            mv = mv[:RECV_CHUNK]
        n = self.sock.recv_into(mv)
        if n:
            self.received_any = True
        return n

    def read_until(self, needle: bytes, limit: int) -> bytes:
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
            if self.fill() == 0:
                raise ConnectionResetError("server closed the connection")


class SyncBody(httpx.SyncByteStream):
    """The body of one response. ``readinto`` receives into caller memory; iterating
    yields ``bytes`` (what httpx's ``read()``/``iter_bytes()`` use)."""

    def __init__(
        self, transport: SyncTransport, conn: _Conn, head: ResponseHead, request: httpx.Request
    ) -> None:
        self._transport = transport
        self._conn: _Conn | None = conn
        self._request = request
        self._keep_alive = head.keep_alive
        self._chunked = head.chunked
        self._remaining = head.content_length  # None: until close (or chunked)
        self._chunk_left = 0
        self.done = head.content_length == 0
        self.length = head.content_length
        if self.done:
            self.close()

    def readinto(self, mv: memoryview) -> int:
        """Receive up to ``len(mv)`` body bytes into ``mv``; 0 at the end of the body."""
        conn = self._conn
        if self.done or conn is None or len(mv) == 0:
            return 0
        try:
            if self._chunked:
                return self._readinto_chunked(conn, mv)
            if self._remaining is None:
                n = conn.readinto(mv)
                if n == 0:
                    self._keep_alive = False
                    self._finish()
                return n
            if len(mv) > self._remaining:
                mv = mv[: self._remaining]
            n = conn.readinto(mv)
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
        except httpx.HTTPError:
            self._abort()
            raise

    def _readinto_chunked(self, conn: _Conn, mv: memoryview) -> int:
        while self._chunk_left == 0:
            line = conn.read_until(b"\r\n", 4096)
            if line == b"\r\n":  # the CRLF closing the previous chunk
                continue
            size = _http11.parse_chunk_size(line, self._request)
            if size == 0:
                while conn.read_until(b"\r\n", 16384) != b"\r\n":
                    pass  # trailers
                self._finish()
                return 0
            self._chunk_left = size
        if len(mv) > self._chunk_left:
            mv = mv[: self._chunk_left]
        n = conn.readinto(mv)
        if n == 0:
            raise httpx.RemoteProtocolError(
                "connection closed inside a chunk", request=self._request
            )
        self._chunk_left -= n
        return n

    def __iter__(self) -> Iterator[bytes]:
        chunk = memoryview(bytearray(RECV_CHUNK))
        while True:
            n = self.readinto(chunk)
            if n == 0:
                return
            yield bytes(chunk[:n])

    def _finish(self) -> None:
        self.done = True
        self.close()

    def _abort(self) -> None:
        self._keep_alive = False
        self.done = True
        self.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self.done and self._keep_alive and conn.pending == 0:
            self._transport._release(conn)
        else:
            conn.close()


class SyncTransport(httpx.BaseTransport):
    """``httpx.BaseTransport`` over plain sockets, with zero-copy bodies.

    >>> client = httpx.Client(transport=SyncTransport())  # doctest: +SKIP
    """

    def __init__(self, *, max_keepalive: int = 16, keepalive_expiry: float = 4.0) -> None:
        self._max_keepalive = max_keepalive
        self._expiry = keepalive_expiry
        self._idle: dict[_Key, list[_Conn]] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- pool ---------------------------------------------------------------------
    def _acquire(self, key: _Key, connect_timeout: float | None) -> tuple[_Conn, bool]:
        now = time.monotonic()
        stale: list[_Conn] = []
        found: _Conn | None = None
        with self._lock:
            idle = self._idle.get(key)
            while idle:
                conn = idle.pop()
                if now - conn.last_used > self._expiry:
                    stale.append(conn)
                    continue
                found = conn
                break
        for conn in stale:
            conn.close()
        if found is not None:
            if not found.dropped():
                return found, True
            found.close()
        sock = socket.create_connection(key, timeout=connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Conn(sock, key), False

    def _release(self, conn: _Conn) -> None:
        conn.last_used = time.monotonic()
        conn.received_any = False
        with self._lock:
            if not self._closed:
                idle = self._idle.setdefault(conn.key, [])
                if len(idle) < self._max_keepalive:
                    idle.append(conn)
                    return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    # -- requests -----------------------------------------------------------------
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"SyncTransport speaks http:// only, not {url.scheme}://", request=request
            )
        key = (url.host, url.port or 80)
        timeouts = request.extensions.get("timeout", {})
        head_bytes = _http11.request_head(request)
        for attempt in (0, 1):
            try:
                conn, reused = self._acquire(key, timeouts.get("connect"))
            except TimeoutError:
                raise httpx.ConnectTimeout(f"connecting to {key}", request=request) from None
            except OSError as exc:
                raise httpx.ConnectError(f"connecting to {key}: {exc}", request=request) from exc
            try:
                conn.sock.settimeout(timeouts.get("write"))
                phase = "write"
                self._send(conn, head_bytes, request)
                conn.sock.settimeout(timeouts.get("read"))
                phase = "read"
                head = self._read_head(conn, request)
            except (OSError, ValueError) as exc:
                early = None
                if phase == "write" and not isinstance(exc, TimeoutError | ValueError):
                    early = self._early_answer(conn, request, timeouts.get("read"))
                if early is not None:
                    return self._response(conn, early, request, keep_alive=False)
                conn.close()
                if isinstance(exc, TimeoutError):
                    kind = httpx.WriteTimeout if phase == "write" else httpx.ReadTimeout
                    raise kind(f"timed out ({phase})", request=request) from None
                if reused and attempt == 0 and not conn.received_any:
                    continue  # the server had closed the idle connection: once more
                if isinstance(exc, ValueError):
                    raise httpx.RemoteProtocolError(str(exc), request=request) from exc
                kind2 = httpx.WriteError if phase == "write" else httpx.ReadError
                raise kind2(f"{phase}: {exc}", request=request) from exc
            except BaseException:
                conn.close()
                raise
            return self._response(conn, head, request, keep_alive=head.keep_alive)
        raise AssertionError("unreachable")  # pragma: no cover

    def _early_answer(
        self, conn: _Conn, request: httpx.Request, timeout: float | None
    ) -> ResponseHead | None:
        """After a failed write: the answer the server sent before closing (an early
        413/401/400 that rejected the body), if it can still be read."""
        try:
            conn.sock.settimeout(timeout if timeout is not None else 5.0)
            return self._read_head(conn, request)
        except (OSError, ValueError, httpx.HTTPError):
            return None

    def _response(
        self, conn: _Conn, head: ResponseHead, request: httpx.Request, *, keep_alive: bool
    ) -> httpx.Response:
        head.keep_alive = keep_alive
        body = SyncBody(self, conn, head, request)
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
    def _send(conn: _Conn, head: bytes, request: httpx.Request) -> None:
        sock = conn.sock
        pending = head
        stream = request.stream
        if not isinstance(stream, httpx.SyncByteStream):
            raise TypeError("SyncTransport needs a sync request stream")
        for chunk in stream:
            if len(chunk) < SEND_COALESCE:
                pending += chunk
                continue
            if pending:
                sock.sendall(pending)
                pending = b""
            sock.sendall(chunk)
        if pending:
            sock.sendall(pending)

    @staticmethod
    def _read_head(conn: _Conn, request: httpx.Request) -> ResponseHead:
        while True:
            data = conn.read_until(b"\r\n\r\n", _http11.MAX_HEAD_BYTES)
            head = _http11.parse_response_head(data, request)
            if 100 <= head.status < 200 and head.status != 101:
                continue
            return head
