"""The SDK's HTTP/1.1 transport for httpx: h11 frames every message, sockets are the
SDK's own so that a body can go from and into caller memory.

httpx's stock transport reads 64 KiB at a time and copies each piece several times on
its way to ``Response.content``. This one keeps httpx's API (requests, headers,
timeouts, event hooks) and:

* parses and frames every request and response with h11 (status line, headers,
  ``Content-Length``, ``Transfer-Encoding: chunked`` with trailers, ``HEAD``, 1xx),
  but for the plain response heads of nearly every ec-cache answer and the plain
  heads of the clients' GET and HEAD, which ``ec_cache._head`` parses and writes by
  h11's rules in a fifth of its time (h11 is told of such a request only when the
  answer needs it);
* sends request bodies from the caller's buffers (``memoryview`` s of tensor memory);
* exposes ``response.extensions["ec_body"]``, whose ``readinto(buffer)`` fills caller
  memory. Once the bytes received with the head are handed over (by h11, or kept
  with a plain head), the rest of a ``Content-Length`` body is received with
  ``recv_into`` straight into the buffer (h11 would copy every byte twice);
* sends ``Expect: 100-continue`` requests in two steps: the head, then the body only
  after ``100 Continue`` (or ``EXPECT_TIMEOUT`` seconds of silence); a final answer
  in between (412, 413, 401) means the body is never sent;
* pools keep-alive connections per ``(host, port)``. A connection goes back to the
  pool only when both the request and the response were complete and the server
  did not ask to close; it is checked for a server-side close before reuse, and a
  request whose reused connection turns out dead before any byte of the answer
  arrived is sent once more on a fresh connection. At most ``max_connections``
  requests per replica are in flight; the next one waits up to the ``pool`` timeout.

``send(key, Outgoing, timeouts)`` is the same exchange without an ``httpx.Request``:
the clients' own requests use it, ``handle_async_request`` adapts httpx's requests to it.

``http://`` only; the clients use httpx's stock transport for ``https://``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping

import h11
import httpx

from .._backends import AsyncSemaphore, AsyncSocket
from .._call_limit import CallLimit
from .._head import Head, parse_plain_head, plain_request_head

__all__ = ["AsyncResponseBody", "AsyncTransport"]

HEAD_RECV = 64 * 1024
"""Receive size while h11 parses (response heads, chunked bodies)."""
MAX_HEAD_BYTES = 64 * 1024
"""Largest response head (and chunk header, trailer section) accepted."""
MAX_INTERIM = 16
"""Most 1xx answers accepted before the final one."""
SEND_COALESCE = 64 * 1024
"""Body pieces below this are sent in one write with the request head."""
EXPECT_TIMEOUT = 1.0
"""Seconds to wait for ``100 Continue`` before sending the body anyway (as curl)."""

_Key = tuple[str, int]
_Answer = tuple[Head, int | None]
"""A final response head and the length of its body when the transport frames it
(``Content-Length``, or 0 after a plain head without a body); ``None``: h11 frames it."""


class _Closed(ConnectionResetError):
    """The server closed the connection before (or instead of) answering."""


class Outgoing:
    """One request as the transport sends it: what ``handle_async_request`` takes
    from an ``httpx.Request``, or what :meth:`AsyncTransport.send` is given directly
    (the clients' own requests, which skip building an ``httpx.Request``).
    ``request`` is the ``httpx.Request`` named by exceptions, when there is one;
    ``limit`` bounds the whole exchange, body included (see ``ec_cache._call_limit``)."""

    __slots__ = ("expect", "headers", "limit", "method", "request", "stream", "target")

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        stream: httpx.AsyncByteStream | None,
        request: httpx.Request | None,
        limit: CallLimit | None = None,
    ) -> None:
        self.limit = limit
        self.method = method
        self.target = target
        self.headers = headers
        self.stream = stream
        self.request = request
        self.expect = any(
            name.lower() == b"expect" and value.lower() == b"100-continue"
            for name, value in headers
        )


def _keep_alive(head: Head) -> bool:
    if head.http_version != b"1.1":
        return False
    for name, value in head.fields:
        if name == b"connection" and b"close" in [t.strip() for t in value.lower().split(b",")]:
            return False
    return True


def _h11_answer(event: h11.Response, method: bytes) -> _Answer:
    head = Head.of(event)
    return head, _content_length_framed(head, method)


def _content_length_framed(head: Head, method: bytes) -> int | None:
    """The body length when the body is framed by ``Content-Length`` alone."""
    if method == b"HEAD" or head.status_code in (204, 304):
        return None
    length: int | None = None
    for name, value in head.fields:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            length = int(value)  # h11 has checked it: digits, no conflicting copies
    return length


class AsyncConnection:
    """One socket and the h11 state of its current request/response cycle."""

    def __init__(self, sock: AsyncSocket, key: _Key) -> None:
        self.sock = sock
        self.key = key
        self.last_used = time.monotonic()
        self.closed = False
        self._buf = bytearray(HEAD_RECV)
        self.limit: CallLimit | None = None  # of the request in progress
        self.reset()

    def reset(self) -> None:
        """A fresh cycle (a new ``h11.Connection``: the last body may have bypassed
        h11's bookkeeping)."""
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._plain_request: Outgoing | None = None  # written without h11, not yet told
        self.h11_fed = False  # whether h11 was given any received bytes
        self.received_any = False
        self.early = b""  # body bytes received with a plain head (h11 never saw them)

    @property
    def h11_state(self) -> h11.Connection:
        """h11's state of this cycle; told of a plain request first, when there was one."""
        out, self._plain_request = self._plain_request, None
        if out is not None:
            self._h11.send(h11.Request(method=out.method, target=out.target, headers=out.headers))
            self._h11.send(h11.EndOfMessage())
        return self._h11

    def sent_plain(self, out: Outgoing) -> None:
        """``out`` went out as a plain request head (h11 is told only if it is needed)."""
        self._plain_request = out

    @property
    def request_complete(self) -> bool:
        return self._plain_request is not None or self._h11.our_state is h11.DONE

    def feed_h11(self, data: bytes | memoryview) -> None:
        self.h11_state.receive_data(data)  # type: ignore[arg-type]
        self.h11_fed = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    async def next_event(
        self, timeout: float | None, deadline: float | None = None
    ) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        """The next h11 event, receiving as needed; ``deadline`` (monotonic) bounds the
        whole wait, ``timeout`` each receive."""
        while True:
            event = self.h11_state.next_event()
            if event is not h11.NEED_DATA:
                return event
            n = await self._receive(timeout, deadline)
            self.feed_h11(memoryview(self._buf)[:n] if n else b"")

    async def plain_head(
        self, method: bytes, timeout: float | None, deadline: float | None
    ) -> tuple[Head, int] | None:
        """The first receive of an answer, when it starts with a plain head (see
        ``ec_cache._head``): the head and its body length, the body bytes after it kept
        in ``early``. Else ``None``, and the bytes go to h11 (``next_event`` goes on)."""
        n = await self._receive(timeout, deadline)
        plain = parse_plain_head(self._buf, n, method)
        received = memoryview(self._buf)[:n]
        if plain is None:
            self.feed_h11(received)
            return None
        self.early = bytes(received[plain.body_start :])
        return plain.head, plain.body_length

    async def recv_into(
        self, mv: memoryview, timeout: float | None, deadline: float | None = None
    ) -> int:
        """One receive into ``mv``: ``TimeoutError`` after ``timeout`` seconds without
        data, at ``deadline`` (monotonic), or when the request's own limit is reached."""
        end = deadline
        if timeout is not None:
            end = min(time.monotonic() + timeout, end if end is not None else float("inf"))
        while True:
            wait = None if end is None else end - time.monotonic()
            if wait is not None and wait <= 0:
                raise TimeoutError("nothing received in time")
            if self.limit is not None:
                wait = self.limit.wait(wait)
            try:
                n = await self.sock.recv_into(mv, wait)
            except TimeoutError:
                if self.limit is None:
                    raise
                continue
            if self.limit is not None:
                self.limit.received(n)
            return n

    async def _receive(self, timeout: float | None, deadline: float | None) -> int:
        n = await self.recv_into(memoryview(self._buf), timeout, deadline)
        if n:
            self.received_any = True
        elif not self.received_any:
            # h11 would call this a protocol error; it is a connection the server
            # closed (a kept-alive one: resent once, as after a reset).
            raise _Closed("server closed the connection without answering")
        return n


class AsyncResponseBody(httpx.AsyncByteStream):
    """The body of one response. ``readinto`` fills caller memory; iterating yields
    ``bytes`` (what httpx's ``read()``/``iter_bytes()`` use)."""

    def __init__(
        self,
        transport: AsyncTransport,
        conn: AsyncConnection,
        head: Head,
        framed_length: int | None,
        out: Outgoing,
        *,
        request_complete: bool,
        read_timeout: float | None,
        release_slot: Callable[[], None],
    ) -> None:
        self._transport = transport
        self._conn: AsyncConnection | None = conn
        self._request = out.request
        self._timeout = read_timeout
        self._release_slot: Callable[[], None] | None = release_slot
        self._keep_alive = request_complete and _keep_alive(head)
        self._direct_length = framed_length
        self.length = framed_length
        self._direct_left: int | None = None  # bytes left to receive past h11
        # Undelivered received bytes: of h11's last Data event, or of a plain head's read.
        early, conn.early = conn.early, b""
        if framed_length is not None and len(early) > framed_length:
            self._keep_alive = False  # bytes after the body
            early = early[:framed_length]
        self._left = memoryview(early)
        self._delivered = len(early)  # body bytes handed over before the direct ones
        self.done = False

    async def readinto(self, mv: memoryview) -> int:
        """Receive up to ``len(mv)`` body bytes into ``mv``; 0 at the end of the body."""
        conn = self._conn
        if self.done or conn is None or len(mv) == 0:
            return 0
        try:
            while True:
                if self._left:
                    n = min(len(mv), len(self._left))
                    mv[:n] = self._left[:n]
                    self._left = self._left[n:]
                    return n
                if self._direct_left is not None:
                    return await self._readinto_direct(conn, mv)
                if self._direct_length is not None and not conn.h11_fed:
                    # after a plain head: nothing of the body is in h11's buffer
                    self._direct_left = self._direct_length - self._delivered
                    continue
                event = conn.h11_state.next_event()
                if event is h11.NEED_DATA:
                    if self._direct_length is not None:
                        # h11's buffer is empty: the rest goes straight into ``mv``
                        self._direct_left = self._direct_length - self._delivered
                        continue
                    event = await conn.next_event(self._timeout)
                if isinstance(event, h11.Data):
                    self._left = memoryview(event.data)
                    self._delivered += len(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    h = conn.h11_state
                    if h.our_state is not h11.DONE or h.their_state is not h11.DONE:
                        self._keep_alive = False
                    elif h.trailing_data[0]:
                        self._keep_alive = False  # bytes after the body
                    self._finish()
                    return 0
                else:
                    raise httpx.RemoteProtocolError(
                        f"unexpected {type(event).__name__} in a response body",
                        request=self._request,
                    )
        except TimeoutError as exc:
            self._abort()
            why = str(exc) or "timed out"
            raise httpx.ReadTimeout(f"reading the body: {why}", request=self._request) from None
        except h11.RemoteProtocolError as exc:
            self._abort()
            raise httpx.RemoteProtocolError(f"body: {exc}", request=self._request) from None
        except OSError as exc:
            self._abort()
            raise httpx.ReadError(f"reading the body: {exc}", request=self._request) from exc
        except BaseException:
            self._abort()
            raise

    async def _readinto_direct(self, conn: AsyncConnection, mv: memoryview) -> int:
        left = self._direct_left
        assert left is not None
        if left == 0:
            self._finish()
            return 0
        # Ask for all that is left, as BufferedReader does: the kernel hands over what the
        # socket holds (~1 MB under load). A cap of 256 KiB made a 4.7 MB body ~21
        # receives and, with the CRC of each piece, ~40 GIL hand-offs: 16 threads
        # sharing a Client made 176 futex calls per GET (strace), urllib3 44.
        n = await conn.recv_into(mv[:left] if left < len(mv) else mv, self._timeout)
        if n == 0:
            raise httpx.RemoteProtocolError(
                f"server closed the connection with {left} body bytes missing",
                request=self._request,
            )
        self._direct_left = left - n
        if self._direct_left == 0:
            self._finish()
        return n

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunk = memoryview(bytearray(HEAD_RECV))
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
        release, self._release_slot = self._release_slot, None
        if conn is not None:
            if self.done and self._keep_alive:
                self._transport._release(conn)
            else:
                conn.close()
        if release is not None:
            release()

    async def aclose(self) -> None:
        self._close_now()


class AsyncTransport(httpx.AsyncBaseTransport):
    """``httpx`` transport over the SDK's own sockets, with zero-copy bodies.

    >>> client = httpx.AsyncClient(transport=AsyncTransport())  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        max_connections: int = 100,
        max_keepalive: int = 16,
        keepalive_expiry: float = 4.0,
    ) -> None:
        self._max_connections = max_connections
        self._max_keepalive = max_keepalive
        self._expiry = keepalive_expiry
        self._idle: dict[_Key, list[AsyncConnection]] = {}
        self._slots: dict[_Key, AsyncSemaphore] = {}
        self._lock = threading.Lock()  # never held across an await
        self._closed = False

    # -- pool ---------------------------------------------------------------------
    def _slot(self, key: _Key) -> AsyncSemaphore:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = AsyncSemaphore(self._max_connections)
            return slot

    async def _acquire(
        self, key: _Key, connect_timeout: float | None
    ) -> tuple[AsyncConnection, bool]:
        now = time.monotonic()
        stale: list[AsyncConnection] = []
        found: AsyncConnection | None = None
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
            if not found.sock.readable():  # readable while idle: closed, or garbage
                return found, True
            found.close()
        sock = await AsyncSocket.connect(key[0], key[1], connect_timeout)
        return AsyncConnection(sock, key), False

    def _release(self, conn: AsyncConnection) -> None:
        conn.last_used = time.monotonic()
        conn.reset()
        with self._lock:
            if not self._closed:
                idle = self._idle.setdefault(conn.key, [])
                if len(idle) < self._max_keepalive:
                    idle.append(conn)
                    return
        conn.close()

    async def aclose(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    # -- requests -----------------------------------------------------------------
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"the ec-cache transport speaks http:// only, not {url.scheme}://",
                request=request,
            )
        stream = request.stream
        if not isinstance(stream, httpx.AsyncByteStream):
            raise TypeError("this transport needs a request stream of its own kind")
        out = Outgoing(
            request.method.encode(), url.raw_path or b"/", request.headers.raw, stream, request
        )
        return await self.send(
            (url.host, url.port or 80), out, request.extensions.get("timeout", {})
        )

    async def send(
        self, key: _Key, out: Outgoing, timeouts: Mapping[str, float | None]
    ) -> httpx.Response:
        """Send ``out`` to ``key`` (host, port) and return the response once its head
        is in; its body is ``response.extensions["ec_body"]``. ``timeouts`` has httpx's
        keys (``connect``, ``read``, ``write``, ``pool``). Raises httpx's exceptions."""
        request = out.request
        limit = out.limit
        slot = self._slot(key)
        pool_wait = timeouts.get("pool")
        try:
            if limit is not None:
                pool_wait = limit.wait(pool_wait, poll=False)
        except TimeoutError:
            raise httpx.PoolTimeout("the call's timeout expired", request=request) from None
        if not await slot.acquire(pool_wait):
            raise httpx.PoolTimeout(
                f"all {self._max_connections} connections to {key[0]}:{key[1]} stayed busy",
                request=request,
            )
        try:
            for attempt in (0, 1):
                try:
                    connect = timeouts.get("connect")
                    if limit is not None:
                        connect = limit.wait(connect, poll=False)
                    conn, reused = await self._acquire(key, connect)
                except TimeoutError:
                    raise httpx.ConnectTimeout(f"connecting to {key}", request=request) from None
                except OSError as exc:
                    raise httpx.ConnectError(
                        f"connecting to {key}: {exc}", request=request
                    ) from exc
                try:
                    return await self._exchange(conn, out, timeouts, slot.release)
                except _Stale as stale:
                    if reused and attempt == 0:
                        continue  # the server had closed the idle connection: once more
                    raise stale.error from None
            raise AssertionError("unreachable")  # pragma: no cover
        except BaseException:
            slot.release()
            raise

    async def _exchange(
        self,
        conn: AsyncConnection,
        out: Outgoing,
        timeouts: Mapping[str, float | None],
        release_slot: Callable[[], None],
    ) -> httpx.Response:
        request = out.request
        conn.limit = out.limit
        plain = None
        if out.stream is None:  # GET, HEAD: the head may be written without h11
            plain = plain_request_head(out.method, out.target, out.headers)
        if plain is not None:
            head = plain
            conn.sent_plain(out)
        else:
            try:
                head = conn.h11_state.send(
                    h11.Request(method=out.method, target=out.target, headers=out.headers)
                )
            except h11.LocalProtocolError as exc:
                conn.close()
                raise httpx.LocalProtocolError(str(exc), request=request) from None
        write_timeout, read_timeout = timeouts.get("write"), timeouts.get("read")
        phase = "write"
        try:
            answer: _Answer | None = None
            if out.expect:
                await conn.sock.sendall(head, write_timeout)
                head = b""
                answer = await self._await_continue(conn, read_timeout, out.method)
            if answer is None:
                if plain is not None:
                    await conn.sock.sendall(plain, write_timeout)
                else:
                    await self._send_body(conn, head, out.stream, write_timeout)
                phase = "read"
                answer = await self._read_head(conn, read_timeout, out.method)
        except (OSError, h11.ProtocolError) as exc:
            early = None
            if phase == "write" and not isinstance(exc, TimeoutError | h11.ProtocolError):
                early = await self._early_answer(conn, read_timeout, out.method)
            if early is not None:
                return self._response(conn, early, out, read_timeout, release_slot)
            conn.close()
            if isinstance(exc, TimeoutError):
                kind = httpx.WriteTimeout if phase == "write" else httpx.ReadTimeout
                raise kind(f"timed out ({phase})", request=request) from None
            if isinstance(exc, h11.LocalProtocolError):
                raise httpx.LocalProtocolError(str(exc), request=request) from None
            error: httpx.TransportError
            if isinstance(exc, h11.RemoteProtocolError):
                error = httpx.RemoteProtocolError(str(exc), request=request)
            elif phase == "write":
                error = httpx.WriteError(f"write: {exc}", request=request)
            else:
                error = httpx.ReadError(f"read: {exc}", request=request)
            if not conn.received_any and isinstance(exc, OSError):
                raise _Stale(error) from exc  # resent once if the connection was reused
            raise error from exc
        except BaseException:
            conn.close()
            raise
        return self._response(conn, answer, out, read_timeout, release_slot)

    def _response(
        self,
        conn: AsyncConnection,
        answer: _Answer,
        out: Outgoing,
        read_timeout: float | None,
        release_slot: Callable[[], None],
    ) -> httpx.Response:
        response_head, framed_length = answer
        if out.limit is not None:
            out.limit.body_started()
        body = AsyncResponseBody(
            self,
            conn,
            response_head,
            framed_length,
            out,
            request_complete=conn.request_complete,
            read_timeout=read_timeout,
            release_slot=release_slot,
        )
        return httpx.Response(
            response_head.status_code,
            headers=response_head.raw,
            stream=body,
            extensions={
                "http_version": b"HTTP/" + response_head.http_version,
                "reason_phrase": response_head.reason,
                "ec_body": body,
            },
        )

    @staticmethod
    async def _send_body(
        conn: AsyncConnection,
        pending: bytes,
        stream: httpx.AsyncByteStream | None,
        timeout: float | None,
    ) -> None:
        """Send what is left of the head, then the body (none when ``stream`` is
        ``None``); ``timeout`` bounds each write (one piece of at most 8 MiB)."""
        h, sock = conn.h11_state, conn.sock
        if stream is not None:
            async for chunk in stream:
                if not chunk:
                    continue
                for part in h.send_with_data_passthrough(h11.Data(data=chunk)) or ():
                    if len(part) < SEND_COALESCE:
                        pending += part
                        continue
                    if pending:
                        await sock.sendall(pending, timeout)
                        pending = b""
                    await sock.sendall(part, timeout)
        pending += h.send(h11.EndOfMessage()) or b""
        if pending:
            await sock.sendall(pending, timeout)

    @staticmethod
    async def _read_head(conn: AsyncConnection, timeout: float | None, method: bytes) -> _Answer:
        """The final response head; interim 1xx answers are skipped (at most
        ``MAX_INTERIM``), and ``timeout`` bounds the whole head, not each receive."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not conn.received_any:  # the common case: a plain head, no h11
            plain = await conn.plain_head(method, timeout, deadline)
            if plain is not None:
                return plain
        for _ in range(MAX_INTERIM + 1):
            event = await conn.next_event(timeout, deadline)
            if isinstance(event, h11.Response):
                return _h11_answer(event, method)
            if not isinstance(event, h11.InformationalResponse):
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}")
        raise h11.RemoteProtocolError(f"more than {MAX_INTERIM} interim (1xx) answers")

    @classmethod
    async def _await_continue(
        cls, conn: AsyncConnection, timeout: float | None, method: bytes
    ) -> _Answer | None:
        """After an ``Expect: 100-continue`` head: ``None`` once the body may be sent
        (``100 Continue``, or silence), the final answer when the server gave one."""
        wait = EXPECT_TIMEOUT if timeout is None else min(EXPECT_TIMEOUT, timeout)
        deadline = time.monotonic() + wait
        for _ in range(MAX_INTERIM + 1):
            try:
                event = await conn.next_event(wait, deadline)
            except TimeoutError:
                return None
            if isinstance(event, h11.InformationalResponse):
                if event.status_code == 100:
                    return None
                continue
            if isinstance(event, h11.Response):
                return _h11_answer(event, method)
            raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}")
        raise h11.RemoteProtocolError(f"more than {MAX_INTERIM} interim (1xx) answers")

    @classmethod
    async def _early_answer(
        cls, conn: AsyncConnection, timeout: float | None, method: bytes
    ) -> _Answer | None:
        """After a failed write: the answer the server sent before closing (an early
        413/401/400 that rejected the body), if it can still be read."""
        try:
            return await cls._read_head(conn, timeout if timeout is not None else 5.0, method)
        except (OSError, h11.ProtocolError):
            return None


class _Stale(Exception):
    """Internal: the connection died before any byte of the answer came; ``error`` is
    what the caller gets unless the request can be sent once more."""

    def __init__(self, error: httpx.TransportError) -> None:
        super().__init__(str(error))
        self.error = error
