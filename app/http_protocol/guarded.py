"""Connection deadlines and a bound on open connections: a uvicorn protocol subclass.

uvicorn's httptools protocol bounds none of these itself: a connection that never sends
a request, a request head trickled a byte at a time (slowloris) and a client that stops
reading a response are all held for as long as the client likes, and so are the upload
or download slot, the task and the mmap'd file behind them. ``GuardedHttpProtocol``
(on top of ``httptools_protocol``'s JSON 400s and held response heads) adds, per connection
and with no task of its own (loop timers only):

* a bound on open connections (``EC_MAX_CONNECTIONS``): one more is answered 503
  ``too_many_connections`` (``Connection: close``, ``Retry-After: 1``) and closed at once;
* an idle deadline (``EC_KEEPALIVE_TIMEOUT``): a connection with no request in progress,
  a new one included, is closed after this long (uvicorn's keep-alive timer, which it
  starts only after a first response);
* a request-head deadline (``EC_HEADER_TIMEOUT``): from the first byte of a request, its
  head (and, for other methods than PUT, its whole body) must be in within this long,
  else 408 ``request_timeout`` and the connection is closed. PUT bodies have their own
  deadlines (``EC_UPLOAD_*``, see ``app.entries``);
* a bound on a request head while it arrives: once more than ``head_bytes`` of a head
  (``EC_MAX_HEADER_BYTES``, plus room for the request line) came in without its end,
  the request is answered 431 ``headers_too_large`` (414 ``uri_too_long`` when the
  target alone is over its bound) and the connection is closed lingering, as below: a
  flood of headers costs the server one socket read of memory, not the flood. The exact
  bounds are the middleware's, once a head is whole (``app.middleware``);
* a send deadline (``EC_SEND_TIMEOUT``): while response bytes wait in the write buffer,
  the client must accept some within this long, else the connection is dropped (reset).
  A reader that stops reading a large GET then frees its download slot, its task and
  the mmap held by the unsent bytes;
* a lingering close, as nginx's ``lingering_close``: a PUT answered before its body was
  read (412 for ``If-None-Match: *``, 413, 401, ...) is answered with ``Connection:
  close``, but closing a socket with unread bytes makes the kernel send a reset, which
  destroys the answer still on its way to a client that keeps sending its body (one
  that gave up waiting for ``100 Continue``, or never asked). So the server shuts down
  its sending side only and discards what still arrives, until the client closes, is
  silent for ``LINGER_IDLE`` s or ``LINGER_TOTAL`` s have passed.

Drops are counted in ``ec_connections_dropped_total{reason}``, open connections in
``ec_connections_open``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
from uvicorn.server import ServerState

from app.error_responses import raw_error_response
from app.http_protocol import max_head_bytes
from app.http_protocol.httptools_protocol import ECHttpToolsProtocol
from app.metrics import ConnectionMetrics
from app.middleware import MAX_TARGET_BYTES
from app.settings import Settings

log = logging.getLogger(__name__)

#: nginx's lingering_timeout and lingering_time: how long a connection closed with a
#: request body unread keeps draining it (see the module docstring).
LINGER_IDLE = 5.0
LINGER_TOTAL = 30.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    keepalive_timeout: float
    header_timeout: float
    send_timeout: float
    max_header_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        return cls(
            settings.max_connections,
            settings.keepalive_timeout,
            settings.header_timeout,
            settings.send_timeout,
            settings.max_header_bytes,
        )

    @property
    def head_bytes(self) -> int:
        return max_head_bytes(self.max_header_bytes)


class GuardedHttpProtocol(ECHttpToolsProtocol):
    """uvicorn's httptools protocol (as ``httptools_protocol`` changes it) and the
    deadlines and bound of the module docstring.

    Use ``guarded_protocol`` to get a subclass bound to limits and metrics."""

    limits: ClassVar[ConnectionLimits]
    metrics: ClassVar[ConnectionMetrics]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.timeout_keep_alive = self.limits.keepalive_timeout  # type: ignore[assignment]
        self._refused = False
        self._counted = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._send_left = 0
        self._send_progress = 0.0
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_until = 0.0
        self._in_head = False  # between a request's first byte and its head's end
        self._head_began = False  # a head began in the read being parsed
        # Bytes of the head: what was parsed of the read it began in (where in that
        # read it began is not known), then every read. Never more than the head, so
        # never an acceptable head refused; a flood is cut off one read past the bound.
        self._head_counted = 0

    # -- the bound and the idle deadline -------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refused = True
            self.transport = transport
            self.metrics.dropped.labels("limit").inc()
            transport.write(
                raw_error_response(
                    503,
                    "too_many_connections",
                    f"the server holds its maximum of {self.limits.max_connections} "
                    "connections: retry",
                    [(b"retry-after", b"1")],
                )
            )
            transport.close()
            return
        super().connection_made(transport)
        self._counted = True
        self.metrics.open.inc()
        # uvicorn arms its keep-alive timer only after a response: arm it for the
        # first request too, so a connection that never sends one is closed.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._send_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._send_timer = self._linger_timer = None
        if self._refused:
            return
        if self._counted:
            self._counted = False
            self.metrics.open.dec()
        super().connection_lost(exc)

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self.metrics.dropped.labels("idle").inc()
        super().timeout_keep_alive_handler()
        self._watch_send()  # bytes still unsent: the send deadline still applies

    # -- the request-head deadline ------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._linger_timer is not None:  # the rest of an unread body: discarded
            self._linger_timer.cancel()
            self._linger_timer = self.loop.call_at(
                min(self.loop.time() + LINGER_IDLE, self._linger_until), self.transport.close
            )
            return
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._head_timer = self.loop.call_later(
                self.limits.header_timeout, self._head_timed_out
            )
        self._head_began = False
        super().data_received(data)
        if self._in_head:
            if not self._head_began:  # the whole read is the head's
                self._head_counted += len(data)
            else:  # the head began in this read: what of it was parsed
                self._head_counted = len(self.url) + sum(
                    len(name) + len(value) + 4 for name, value in self.headers
                )
            if self._head_counted > self.limits.head_bytes:
                self._head_too_large()

    # -- the request-head bound ---------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = self._head_began = True
        self._head_counted = 0

    def _head_too_large(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        self.metrics.dropped.labels("headers_too_large").inc()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self.transport.abort()  # a pipelined head behind an answer still going out
            return
        if len(self.url) > MAX_TARGET_BYTES:
            status, code = 414, "uri_too_long"
            message = f"request target exceeds {MAX_TARGET_BYTES} bytes"
        else:
            status, code = 431, "headers_too_large"
            message = f"request headers exceed {self.limits.max_header_bytes} bytes"
        self.transport.write(raw_error_response(status, code, message))
        self._close_lingering()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()
        if self.scope.get("method") == "PUT":  # upload bodies: app.entries' deadlines
            self._cancel_head_timer()
            cycle = self.cycle
            cycle.transport = _LingeringTransport(self.transport, self, cycle)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if not self._upgrade_body_skipped():  # else its body is still to come
            self._cancel_head_timer()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        self.metrics.dropped.labels("header_timeout").inc()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:  # cannot answer any more: drop
                self.transport.abort()
                return
            # The app is waiting for the body: it sees a disconnect, sends nothing.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.write(
            raw_error_response(
                408,
                "request_timeout",
                f"request not received within {self.limits.header_timeout:g} s",
            )
        )
        self.transport.close()

    # -- the lingering close ------------------------------------------------------

    def close_after_response(self, cycle: RequestResponseCycle) -> None:
        """``transport.close()`` of an upload's response cycle: close, or linger while
        the request body is still arriving (see the module docstring)."""
        if not cycle.response_complete or not cycle.more_body:  # an app that failed
            self.transport.close()  # mid-answer (drop at once), or nothing to drain
        else:
            self._close_lingering()

    def _close_lingering(self) -> None:
        """Close after what is buffered, draining what the client still sends."""
        transport = self.transport
        if transport.is_closing() or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()  # after the answer still buffered
        self.flow.resume_reading()
        self._linger_until = self.loop.time() + LINGER_TOTAL
        self._linger_timer = self.loop.call_later(LINGER_IDLE, transport.close)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._linger_timer is not None:
            self._unset_keepalive_if_required()  # the linger deadlines apply instead
        self._watch_send()

    # -- the send deadline --------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_send()

    def _watch_send(self) -> None:
        """Check the write buffer until it is empty; drop the connection when it has
        not shrunk for ``send_timeout`` seconds."""
        if self._send_timer is not None or self._refused:
            return
        left = self.transport.get_write_buffer_size()
        if left == 0:
            return
        self._send_left = left
        self._send_progress = self.loop.time()
        self._send_timer = self.loop.call_later(self._send_tick, self._check_send)

    @property
    def _send_tick(self) -> float:
        return min(1.0, self.limits.send_timeout / 4)

    def _check_send(self) -> None:
        self._send_timer = None
        left = self.transport.get_write_buffer_size()
        if left == 0:
            return
        now = self.loop.time()
        if left < self._send_left:
            self._send_left = left
            self._send_progress = now
        elif now - self._send_progress >= self.limits.send_timeout:
            self.metrics.dropped.labels("send_timeout").inc()
            log.warning(
                "dropping %s: it accepted no response bytes for %g s (%d unsent)",
                f"{self.client[0]}:{self.client[1]}" if self.client else "a client",
                self.limits.send_timeout,
                left,
            )
            self.transport.abort()
            return
        self._send_timer = self.loop.call_later(self._send_tick, self._check_send)


class _LingeringTransport:
    """The transport as an upload's response cycle sees it: its ``close`` may linger."""

    __slots__ = ("_cycle", "_protocol", "_transport")

    def __init__(
        self,
        transport: asyncio.Transport,
        protocol: GuardedHttpProtocol,
        cycle: RequestResponseCycle,
    ) -> None:
        self._transport = transport
        self._protocol = protocol
        self._cycle = cycle

    def close(self) -> None:
        self._protocol.close_after_response(self._cycle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded_protocol(
    limits: ConnectionLimits, registry: CollectorRegistry
) -> type[GuardedHttpProtocol]:
    """A ``GuardedHttpProtocol`` subclass for ``uvicorn.run(http=...)``."""
    metrics = ConnectionMetrics(registry)
    return type("ECHttpProtocol", (GuardedHttpProtocol,), {"limits": limits, "metrics": metrics})
