"""uvicorn's httptools protocol, with four changes.

* **JSON 400s.** llhttp refuses some requests before the app can see them: raw
  non-ASCII bytes or spaces in the request target, a malformed or repeated
  ``Content-Length``, bad chunked framing, invalid header bytes. uvicorn then writes a
  plain-text 400 ("Invalid HTTP request received.") and closes the connection; this
  subclass writes the same 400 with the project's JSON error body (``{"error":
  "malformed_request", ...}``, from ``app.error_responses``) instead.
* **A response head leaves with small first body bytes.** uvicorn writes the head of
  a response as soon as the app starts it, then the body: two writes, so the client is
  woken for a head it cannot use without the body, and (on a shared core) the server
  waits while it parses it. A read-through's first bytes (up to 64 KiB) come right
  after its head. For every request but a PUT (whose transport ``guarded``
  wraps for its lingering close) the head is held until the first body write; if that
  is at most ``WITH_HEAD_BYTES`` the two leave in one write, as nginx sends a header
  with its body (``tcp_nopush``). A response that ends with no body write (HEAD, an
  empty body) or closes sends its head then.
* **Upload bodies are read into buffers handed to the app.** uvicorn gets each read
  of the socket as a new ``bytes`` (a copy, by uvloop), has llhttp copy the body out
  of it, appends that to a ``bytearray`` and hands the app a ``bytes`` copy of that:
  four copies of every byte of a PUT, the largest share of the event loop's CPU in a
  4.7 MB ingest. A PUT with a ``Content-Length`` is parsed up to its head (and
  whatever of its body came with it); once its first body bytes are in,
  ``_BodyReader``, an ``asyncio.BufferedProtocol``, takes the transport and the socket
  reads the rest straight into buffers of up to ``BODY_BUFFER_BYTES``, never past the
  body's end. The app gets each read as a ``memoryview`` of its buffer, one per
  ``receive``, through the cycle (``_UploadCycle``). When the body is complete the
  HTTP protocol takes the transport back, the request completes as llhttp would
  complete it, and a fresh parser reads the next request. A body still arriving after
  its answer (a refusal) goes back through the HTTP protocol, which counts it off.
* **Upgrade requests are plain HTTP** (``ws="none"``: nothing is upgraded), their
  bodies included, which llhttp skips for an Upgrade request (``_parse``).
"""

from __future__ import annotations

import asyncio
import ctypes
from collections import deque
from typing import Any

import httptools
from uvicorn._types import ASGIReceiveEvent
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from app.error_responses import raw_error_response

MALFORMED_MESSAGE = (
    "the HTTP parser refused the request: a malformed request line or target "
    "(raw non-ASCII bytes must be percent-encoded), header or body framing"
)


class ECHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with this module's four changes."""

    #: Body bytes of the last PUT whose head was parsed still to come: when a parse
    #: ends with this above 0, llhttp has stopped inside that body, and the rest of
    #: it is counted off here.
    _body_left = 0
    #: The parser is reading the head ``_parse`` made up to frame an Upgrade request's
    #: body: its callbacks up to the end of that head are not a request's.
    _reframing = False

    def data_received(self, data: bytes) -> None:
        left = self._body_left
        if not left:  # the parser holds the request (or its body is llhttp's to frame)
            self._parse(data)
        else:
            body, rest = (data, b"") if len(data) <= left else (data[:left], data[left:])
            self.on_body(body)
            if not self._body_left:
                self._body_done()
                if rest:
                    self._parse(rest)
        # Once body bytes have come (and were not discarded), a reader takes the rest.
        # Not before: installed while the socket was idle (a client waiting for its
        # 100 Continue), it cost the server 2.0-2.3 s of CPU per GB of 4.7 MB PUTs
        # against 1.4 s, nearly all of it in the kernel's copy of the body into the
        # page cache (measured; why, not known).
        cycle = self.cycle
        if (
            self._body_left
            and isinstance(cycle, _UploadCycle)
            and cycle.pieces
            and not self.transport.is_closing()
        ):
            self._switch_protocol(_BodyReader(self))

    def body_read(self, piece: memoryview) -> None:
        """``_BodyReader``'s: ``piece`` of the body was read into its buffer."""
        cycle = self.cycle
        if cycle.response_complete:  # answered early: the rest is the HTTP protocol's
            self._switch_protocol(self)  # to discard (``guarded`` lingers)
            self.data_received(bytes(piece))
            return
        self.on_body(piece)
        if not self._body_left:
            self._switch_protocol(self)
            self._body_done()

    def _parse(self, data: bytes) -> None:
        """uvicorn's ``data_received``, but an Upgrade request stays plain HTTP (nothing
        is upgraded: ``ws="none"``). httptools has llhttp skip such a request's body:
        it ends the request at its head and hands back the rest. A fresh parser frames
        that body (and what follows) again from a head that gives only its framing
        (``_reframing``: that head's request is not a request)."""
        self._unset_keepalive_if_required()
        while data:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            except httptools.HttpParserUpgrade as upgrade:
                rest = data[upgrade.args[0] :]
                self.parser = _new_parser(self)
                framing = _body_framing(self.headers)
                self._reframing = bool(framing)
                data = b"PUT / HTTP/1.1\r\n" + framing + b"\r\n" + rest if framing else rest
                continue
            return

    def _upgrade_body_skipped(self) -> bool:
        """Whether the request just ended by the parser is an Upgrade request's head
        whose body llhttp skipped (see ``_parse``): the request goes on."""
        return self.parser.should_upgrade() and bool(_body_framing(self.headers))

    def on_message_complete(self) -> None:
        if not self._upgrade_body_skipped():
            super().on_message_complete()

    def _body_done(self) -> None:
        """The body is complete: the parser, left inside it, is replaced for the next
        request, and the request completes as llhttp would complete it."""
        self.parser = _new_parser(self)
        self.on_message_complete()

    def _switch_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        transport = self.transport
        transport.set_protocol(protocol)
        if not self.flow.read_paused:  # uvloop picks a protocol's read path at the start
            transport.pause_reading()
            transport.resume_reading()

    def on_headers_complete(self) -> None:
        if self._reframing:  # the head ``_parse`` made up: the request has its cycle
            self._reframing = False
            return
        super().on_headers_complete()
        cycle = self.cycle
        if self.scope.get("method") == "PUT":
            _UploadCycle.adopt(cycle)
            self._body_left = _content_length(self.headers)
        else:
            cycle.transport = _HeadWithBody(self.transport, cycle)  # type: ignore[assignment]

    def on_body(self, body: bytes | memoryview) -> None:
        cycle = self.cycle
        if not isinstance(cycle, _UploadCycle):
            super().on_body(body)  # type: ignore[arg-type]  # bytes: llhttp's
            return
        if self._body_left:  # 0 for a chunked body
            self._body_left -= len(body)
        if not cycle.response_complete:
            cycle.pieces.append(body)
            cycle.piece_bytes += len(body)
            if cycle.piece_bytes > HIGH_WATER_LIMIT:
                self.flow.pause_reading()
            cycle.message_event.set()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(
            raw_error_response(
                400, "malformed_request", MALFORMED_MESSAGE, self.server_state.default_headers
            )
        )
        self.transport.close()


def _new_parser(protocol: HttpToolsProtocol) -> httptools.HttpRequestParser:
    """A parser as uvicorn's protocol makes one."""
    parser = httptools.HttpRequestParser(protocol)
    parser.set_dangerous_leniencies(lenient_data_after_close=True)
    return parser


def _body_framing(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The request's ``Content-Length`` or ``Transfer-Encoding`` header lines, as llhttp
    accepted them (empty: the request has no body)."""
    return b"".join(
        b"%s: %s\r\n" % (name, value)
        for name, value in headers
        if name in (b"content-length", b"transfer-encoding")
    )


def _content_length(headers: list[tuple[bytes, bytes]]) -> int:
    """The request's body length, when framed by one ``Content-Length`` (which llhttp
    has checked) and not chunked; else 0: llhttp frames it."""
    length = 0
    for name, value in headers:
        if name == b"transfer-encoding":
            return 0
        if name == b"content-length":
            length = int(value)
    return length


#: First body bytes up to this size leave with the head; a larger first write follows
#: a head of its own, which the client reads while the body is on its way (the SDK
#: allocates the tensor from it): measured on a 128 KiB disk hit, joining the two cost
#: 0.05-0.1 ms when client and server had a core each.
WITH_HEAD_BYTES = 64 * 1024


class _HeadWithBody:
    """The transport as a response cycle sees it: the response head (the first write
    once the response started) waits for the first body write, or for the response's
    end; see the module docstring."""

    __slots__ = ("_cycle", "_head", "_head_seen", "_on_response", "_transport")

    def __init__(self, transport: asyncio.Transport, cycle: RequestResponseCycle) -> None:
        self._transport = transport
        self._cycle = cycle
        self._head: bytes | None = None
        self._head_seen = False
        # A response with no body write (HEAD, an empty body) ends here: flush first.
        self._on_response = cycle.on_response
        cycle.on_response = self._response_done

    def write(self, data: bytes) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            if len(data) <= WITH_HEAD_BYTES:
                self._transport.write(head + data)
            else:
                self._transport.write(head)
                self._transport.write(data)
        elif not self._head_seen and self._cycle.response_started:
            self._head_seen = True
            self._head = data
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def _response_done(self) -> None:
        self._flush()
        self._on_response()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


#: A PUT body past its head is read into buffers of this size (or of what is left of
#: the body, if less), which are handed to the app as they fill.
BODY_BUFFER_BYTES = 1024 * 1024

# CPython's PyByteArray_FromStringAndSize(NULL, n) leaves the new bytearray's bytes as
# they come from the allocator, where bytearray(n) zeroes them: a memset of every body
# byte (4-5% of a disk-only server's CPU at 16 concurrent 4.7 MB PUTs, by perf) for
# bytes the socket read overwrites before anything sees them (only the filled part of
# a buffer is handed on).
_unzeroed_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_unzeroed_bytearray.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
_unzeroed_bytearray.restype = ctypes.py_object


class _BodyReader(asyncio.BufferedProtocol):
    """The transport's protocol while a PUT's body is read: the socket's bytes go
    straight into buffers that are handed to the app, never past the body's end (the
    next request stays in the socket for the HTTP protocol). Everything else is the
    HTTP protocol's."""

    __slots__ = ("_free", "_protocol")

    def __init__(self, protocol: ECHttpToolsProtocol) -> None:
        self._protocol = protocol
        self._free = memoryview(b"")

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self._free:
            size = min(self._protocol._body_left, BODY_BUFFER_BYTES)
            self._free = memoryview(_unzeroed_bytearray(None, size))
        return self._free

    def buffer_updated(self, nbytes: int) -> None:
        piece, self._free = self._free[:nbytes], self._free[nbytes:]
        self._protocol.body_read(piece)

    def eof_received(self) -> None:
        self._protocol.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._protocol.connection_lost(exc)

    def pause_writing(self) -> None:
        self._protocol.pause_writing()

    def resume_writing(self) -> None:
        self._protocol.resume_writing()


class _UploadCycle(RequestResponseCycle):
    """A PUT's response cycle: its body pieces are handed to the app as they were
    read, not copied into a ``bytearray`` and out again (see the module docstring).
    ``ECHttpToolsProtocol.on_body`` fills ``pieces``."""

    pieces: deque[bytes | memoryview]
    piece_bytes: int

    @classmethod
    def adopt(cls, cycle: RequestResponseCycle) -> None:
        """Make the cycle uvicorn has just made (its task not yet run) one of these."""
        cycle.__class__ = cls
        assert isinstance(cycle, cls)
        cycle.pieces = deque()
        cycle.piece_bytes = 0

    async def receive(self) -> ASGIReceiveEvent:
        # uvicorn's receive, but for the body: one piece per message, as it came.
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            if self.piece_bytes <= HIGH_WATER_LIMIT:
                self.flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        pieces = self.pieces
        body = pieces.popleft() if pieces else b""
        self.piece_bytes -= len(body)
        if pieces:  # the next one is for the next call, at once
            self.message_event.set()
        more_body = self.more_body or bool(pieces)
        # A memoryview of a read buffer where ASGI says bytes: the app (``Store.put``)
        # takes any bytes-like piece.
        return {"type": "http.request", "body": body, "more_body": more_body}  # type: ignore[typeddict-item]
