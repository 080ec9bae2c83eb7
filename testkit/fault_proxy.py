"""An HTTP/1.1 proxy on 127.0.0.1 that counts requests and breaks them on purpose, in
front of an ec-cache server or an S3 endpoint.

Unless a fault applies, the bytes pass unchanged, each client connection on an
upstream connection of its own: keep-alive, streamed and chunked bodies,
``Expect: 100-continue`` and the Host header that S3 signatures cover; also as a
forward proxy (``HTTP_PROXY``). The proxy reads each request's head on the way, to
keep a log of them (:meth:`FaultProxy.count`, :meth:`~FaultProxy.snapshot`,
:meth:`~FaultProxy.headers_of`, :attr:`~FaultProxy.seen`) and to apply these faults,
each of which can be changed while it runs:

``down``
    an outage: open connections are cut, new ones reset at once.
``failures[method] = n``
    the next ``n`` requests of that method are answered by the proxy, their bodies
    read first, with ``status`` (503 SlowDown, 403 AccessDenied) and S3's error
    document.
``put_gate``
    while it is clear, PUTs wait for it once their body is read (an upload held in
    flight; ``puts_held`` counts those waiting).
``delete_gate``
    while it is clear, DELETEs wait for it before they are forwarded (an S3 delete
    held in flight; ``deletes_held`` counts those waiting).
``mode``
    what happens to an ec-cache server's entry GETs (``GET /ec/...``, not ``_exists``):

    * ``pass``: forwarded unchanged;
    * ``kill``: ``on_kill`` (SIGKILL the server) at the first one, then every request
      is reset (a dead server);
    * ``reset``: the connection is reset (the server stays up);
    * ``503``: answered 503, as a server whose S3 tier is unreachable;
    * ``corrupt``: forwarded with the body's last byte flipped (its checksum kept);
    * ``slow``: forwarded after ``delay_s`` (held back, or past a timeout).
``exists_delay_s``
    a namespace's questions (``POST .../_exists``, ``_claim``, ``_release``,
    ``_wait``) are forwarded after that long.
``span_faults[start] = [fault, ...]``
    the next ranged GETs (S3 parts) whose ``Range`` starts at byte ``start`` meet these
    faults, one each, in order: ``reset`` (half the answer's body, then a TCP reset),
    ``500`` (S3's InternalError), ``hold`` (forwarded once ``span_gate`` is set;
    ``spans_held`` counts those waiting).

Another process (a vLLM engine under test) sets ``mode``, ``delay_s`` and
``exists_delay_s`` with ``POST /_fault`` and a JSON object of them.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

MODES = ("pass", "kill", "reset", "503", "corrupt", "slow")
SPAN_FAULTS = ("reset", "500", "hold")
CONTROL_PATH = "/_fault"
S3_ERROR_CODES = {503: "SlowDown", 403: "AccessDenied", 500: "InternalError"}
UNAVAILABLE = b'{"error": {"code": "unavailable", "message": "S3 unreachable"}}'
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Not passed on when the proxy writes an answer itself: it frames the body its own way.
_FRAMING = {"connection", "keep-alive", "transfer-encoding", "content-length"}


@dataclass(frozen=True)
class Request:
    """One request as the proxy read its head."""

    method: str
    target: str  # as sent: a path, or an absolute URL when used as a forward proxy
    headers: dict[str, str]  # names as sent

    def header(self, name: str) -> str:
        return next((v for k, v in self.headers.items() if k.lower() == name), "")

    @property
    def chunked(self) -> bool:
        return self.header("transfer-encoding").lower() == "chunked"

    @property
    def content_length(self) -> int:
        return int(self.header("content-length") or 0)

    @property
    def expects_continue(self) -> bool:
        return self.header("expect").lower() == "100-continue"

    @property
    def is_exists(self) -> bool:
        """A namespace's question: existence, or a claim (its connector form)."""
        return self.method == "POST" and self.target.endswith(
            ("/_exists", "/_claim", "/_release", "/_wait")
        )

    @property
    def span_start(self) -> int | None:
        """Where a ranged GET's ``Range: bytes=a-b`` starts (None: not one)."""
        value = self.header("range")
        if self.method != "GET" or not value.startswith("bytes="):
            return None
        return int(value[len("bytes=") :].partition("-")[0])

    @property
    def is_entry_get(self) -> bool:
        return self.method == "GET" and self.target.startswith("/ec/") and not self.is_exists


@dataclass
class _Conn:
    client: socket.socket
    upstream: socket.socket
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        mode: str = "pass",
        *,
        on_kill: Callable[[], None] | None = None,
        delay_s: float = 0.0,
        exists_delay_s: float = 0.0,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"FaultProxy needs a plain http:// upstream, not {upstream}")
        self.upstream = upstream
        self._upstream_address = (parts.hostname, parts.port or 80)
        self.on_kill = on_kill
        self.configure(mode=mode, delay_s=delay_s, exists_delay_s=exists_delay_s)
        self.killed = threading.Event()
        self.status = 503
        self.failures: Counter[str] = Counter()
        self.put_gate = threading.Event()
        self.put_gate.set()
        self.puts_held = 0
        self.delete_gate = threading.Event()
        self.delete_gate.set()
        self.deletes_held = 0
        self.span_faults: dict[int, list[str]] = {}
        self.span_gate = threading.Event()
        self.span_gate.set()
        self.spans_held = 0
        #: Client connections accepted.
        self.connections = 0
        self._requests: list[Request] = []
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._down = False
        self._stopped = False
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        threading.Thread(target=self._accept_loop, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def configure(
        self,
        *,
        mode: str | None = None,
        delay_s: float | None = None,
        exists_delay_s: float | None = None,
    ) -> None:
        if mode is not None:
            if mode not in MODES:
                raise ValueError(f"unknown fault mode {mode!r}; known: {MODES}")
            self.mode = mode
        if delay_s is not None:
            self.delay_s = float(delay_s)
        if exists_delay_s is not None:
            self.exists_delay_s = float(exists_delay_s)

    # -- the log ------------------------------------------------------------------

    def count(self, method: str | None = None, contains: str | None = None) -> int:
        """Requests seen of ``method`` (any when None) whose target contains ``contains``."""
        with self._lock:
            return sum(
                1
                for r in self._requests
                if (method is None or r.method == method)
                and (contains is None or contains in r.target)
            )

    def snapshot(self) -> list[tuple[str, str]]:
        """``(method, target)`` of every request seen, in order."""
        with self._lock:
            return [(r.method, r.target) for r in self._requests]

    def headers_of(self, method: str) -> list[dict[str, str]]:
        """The headers of every ``method`` request seen, in order."""
        with self._lock:
            return [r.headers for r in self._requests if r.method == method]

    @property
    def seen(self) -> Counter[str]:
        """Requests to an ec-cache server by kind: ``"GET entry"``, ``"POST exists"``..."""
        with self._lock:
            return Counter(
                f"{r.method} {'exists' if r.is_exists else 'entry'}" for r in self._requests
            )

    def reset(self) -> None:
        """Forget the requests seen so far."""
        with self._lock:
            self._requests.clear()

    # -- outage and life cycle ------------------------------------------------------

    @property
    def down(self) -> bool:
        return self._down

    @down.setter
    def down(self, value: bool) -> None:
        self._down = value
        if value:
            with self._lock:
                conns = list(self._conns)
            for conn in conns:
                self._close(conn)

    def close(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.put_gate.set()  # no upload stays held
        self.span_gate.set()
        self.down = True

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connections ----------------------------------------------------------------

    def _accept_loop(self) -> None:
        with contextlib.suppress(OSError):  # the listener was closed
            while not self._stopped:
                self._admit(self._listener.accept()[0])

    def _admit(self, sock: socket.socket) -> None:
        """Serve a client connection on an upstream connection of its own, or reset it
        (an outage, or no upstream: a peer that is not there)."""
        if self._down:
            _reset(sock)
            return
        try:
            upstream = socket.create_connection(self._upstream_address, timeout=5)
            upstream.settimeout(None)
        except OSError:
            _reset(sock)
            return
        conn = _Conn(sock, upstream)
        with self._lock:
            self._conns.append(conn)
            self.connections += 1
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
        threading.Thread(target=self._pump_answers, args=(conn,), daemon=True).start()

    def _close(self, conn: _Conn, *, reset: bool = False) -> None:
        with self._lock:
            if conn.closed:
                return
            conn.closed = True
            with contextlib.suppress(ValueError):
                self._conns.remove(conn)
        if reset:
            _reset(conn.client)
        for sock in (conn.client, conn.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _pump_answers(self, conn: _Conn) -> None:
        """Upstream to client, byte for byte."""
        try:
            while data := conn.upstream.recv(1 << 20):
                with conn.lock:
                    conn.client.sendall(data)
        except OSError:
            pass
        finally:
            self._close(conn)

    def _serve(self, conn: _Conn) -> None:
        """Client to upstream, one request at a time, each through :meth:`_handle`."""
        reader = _Reader(conn.client)
        try:
            while True:
                head = reader.read_until(b"\r\n\r\n", limit=1 << 20)
                if head is None:
                    break
                lines = head.decode("latin-1").split("\r\n")
                method, _, rest = lines[0].partition(" ")
                target = rest.rsplit(" ", 1)[0]
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip()] = value.strip()
                request = Request(method, target, headers)
                if not self._handle(conn, reader, request, head):
                    break
        except OSError:
            pass
        finally:
            self._close(conn)

    # -- requests -------------------------------------------------------------------

    def _handle(self, conn: _Conn, reader: _Reader, request: Request, head: bytes) -> bool:
        """Apply the faults to one request; False when the connection is done."""
        if request.method == "POST" and request.target == CONTROL_PATH:
            return self._control(conn, reader, request)
        with self._lock:
            self._requests.append(request)
        if self.killed.is_set():
            self._close(conn, reset=True)
            return False
        if request.method == "PUT" and (not self.put_gate.is_set() or self.failures["PUT"]):
            return self._held_put(conn, reader, request)
        if request.method == "DELETE" and not self.delete_gate.is_set():
            with self._lock:
                self.deletes_held += 1
            self.delete_gate.wait()
            with self._lock:
                self.deletes_held -= 1
        if self._take_failure(request.method):
            return self._answer_s3_error(conn, reader, request)
        span_fault = self._take_span_fault(request)
        if span_fault == "500":
            self._write_s3_error(conn, request, 500)
            return True
        if span_fault == "reset":
            return self._forward_whole(conn, request, b"", cut=True)
        if span_fault == "hold":
            with self._lock:
                self.spans_held += 1
            self.span_gate.wait()
            with self._lock:
                self.spans_held -= 1
        if request.is_exists and self.exists_delay_s:
            time.sleep(self.exists_delay_s)
        mode = self.mode if request.is_entry_get else "pass"
        if mode == "kill":
            # Reset first: the client must not see the upstream connection's close.
            self.killed.set()
            self._close(conn, reset=True)
            if self.on_kill is not None:
                self.on_kill()
            return False
        if mode == "reset":
            self._close(conn, reset=True)
            return False
        if mode == "503":
            self._answer(
                conn, reader, request, 503, {"Content-Type": "application/json"}, UNAVAILABLE
            )
            return True
        if mode == "corrupt":
            return self._forward_whole(conn, request, reader.read_body(request), corrupt=True)
        if mode == "slow":
            time.sleep(self.delay_s)
        conn.upstream.sendall(head)
        if request.chunked:
            reader.forward_chunked(conn.upstream)
        else:
            reader.forward(request.content_length, conn.upstream)
        return True

    def _take_failure(self, method: str) -> bool:
        with self._lock:
            if self.failures[method] <= 0:
                return False
            self.failures[method] -= 1
            return True

    def _take_span_fault(self, request: Request) -> str | None:
        start = request.span_start
        with self._lock:
            faults = self.span_faults.get(start) if start is not None else None
            return faults.pop(0) if faults else None

    def _control(self, conn: _Conn, reader: _Reader, request: Request) -> bool:
        body = reader.read_body(request)
        try:
            self.configure(**json.loads(body or b"{}"))
        except (ValueError, TypeError) as exc:
            self._write_answer(
                conn, request, 400, {"Content-Type": "text/plain"}, str(exc).encode()
            )
            return True
        self._write_answer(conn, request, 204, {}, b"")
        return True

    def _held_put(self, conn: _Conn, reader: _Reader, request: Request) -> bool:
        """A PUT read whole, held while ``put_gate`` is clear, then failed or forwarded."""
        body = self._read_body(conn, reader, request)
        if not self.put_gate.is_set():
            with self._lock:
                self.puts_held += 1
            self.put_gate.wait()
            with self._lock:
                self.puts_held -= 1
        if self._take_failure("PUT"):
            self._write_s3_error(conn, request)
            return True
        return self._forward_whole(conn, request, body)

    def _answer_s3_error(self, conn: _Conn, reader: _Reader, request: Request) -> bool:
        self._read_body(conn, reader, request)
        self._write_s3_error(conn, request)
        return True

    def _write_s3_error(self, conn: _Conn, request: Request, status: int | None = None) -> None:
        status = status or self.status
        document = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>'
            f"{S3_ERROR_CODES[status]}</Code>"
            f"<Message>injected by the test</Message></Error>"
        ).encode()
        self._write_answer(conn, request, status, {"Content-Type": "application/xml"}, document)

    def _answer(
        self,
        conn: _Conn,
        reader: _Reader,
        request: Request,
        status: int,
        headers: dict[str, str],
        body: bytes,
    ) -> None:
        self._read_body(conn, reader, request)
        self._write_answer(conn, request, status, headers, body)

    def _read_body(self, conn: _Conn, reader: _Reader, request: Request) -> bytes:
        """The request's whole body, after a ``100 Continue`` of the proxy's own if asked."""
        if request.expects_continue:
            with conn.lock:
                conn.client.sendall(CONTINUE)
        return reader.read_body(request)

    def _forward_whole(
        self,
        conn: _Conn,
        request: Request,
        body: bytes,
        *,
        corrupt: bool = False,
        cut: bool = False,
    ) -> bool:
        """The request, its body in hand, on a fresh upstream connection; its whole answer
        back to the client (with the last byte of a 200's body flipped if ``corrupt``;
        only half of the body, then a reset, if ``cut``)."""
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in {"expect", *_FRAMING}
        }
        headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(*self._upstream_address, timeout=30)
        try:
            upstream.request(request.method, request.target, body=body, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
        except (OSError, http.client.HTTPException):
            self._close(conn, reset=True)
            return False
        finally:
            upstream.close()
        if corrupt and answer.status == 200 and data:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        self._write_answer(
            conn, request, answer.status, answer.getheaders(), data, answer.reason, cut=cut
        )
        if cut:
            self._close(conn, reset=True)
        return not cut

    def _write_answer(
        self,
        conn: _Conn,
        request: Request,
        status: int,
        headers: dict[str, str] | list[tuple[str, str]],
        body: bytes,
        reason: str = "",
        *,
        cut: bool = False,
    ) -> None:
        items = headers.items() if isinstance(headers, dict) else headers
        lines = [f"HTTP/1.1 {status} {reason or http.client.responses.get(status, '')}"]
        lines += [f"{k}: {v}" for k, v in items if k.lower() not in _FRAMING]
        lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if cut:
            body = body[: len(body) // 2]
        with conn.lock:
            conn.client.sendall(head if request.method == "HEAD" else head + body)


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a peer whose process died."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


class _Reader:
    """Buffered reads from a socket: up to a delimiter, a counted or chunked forward, or
    a request's whole body."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def read_until(self, delim: bytes, limit: int) -> bytes | None:
        while True:
            index = self.buf.find(delim)
            if index >= 0:
                end = index + len(delim)
                out = bytes(self.buf[:end])
                del self.buf[:end]
                return out
            if len(self.buf) > limit:
                raise OSError("HTTP head too long")
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self.buf += data

    def forward(self, count: int, out: socket.socket | None) -> bytes:
        """Pass ``count`` bytes on to ``out``; with ``out`` None, return them instead."""
        kept = bytearray()
        while count > 0:
            if self.buf:
                data = bytes(self.buf[:count])
                del self.buf[: len(data)]
            else:
                data = self.sock.recv(min(count, 1 << 20))
                if not data:
                    raise OSError("connection closed inside a body")
            if out is None:
                kept += data
            else:
                out.sendall(data)
            count -= len(data)
        return bytes(kept)

    def forward_chunked(self, out: socket.socket | None) -> bytes:
        """Pass a chunked body on to ``out`` as it is; with ``out`` None, return it
        decoded instead."""
        kept = bytearray()
        while True:
            line = self.read_until(b"\r\n", limit=4096)
            if line is None:
                raise OSError("connection closed inside a chunked body")
            if out is not None:
                out.sendall(line)
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = self.read_until(b"\r\n", limit=1 << 16)
                    if trailer is None:
                        raise OSError("connection closed inside chunked trailers")
                    if out is not None:
                        out.sendall(trailer)
                    if trailer == b"\r\n":
                        return bytes(kept)
            chunk = self.forward(size + 2, out)
            kept += chunk[:-2]

    def read_body(self, request: Request) -> bytes:
        if request.chunked:
            return self.forward_chunked(None)
        return self.forward(request.content_length, None)
