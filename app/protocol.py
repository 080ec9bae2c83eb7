"""uvicorn's httptools protocol, with two changes.

* **JSON 400s.** llhttp refuses some requests before the app can see them: raw
  non-ASCII bytes or spaces in the request target, a malformed or repeated
  ``Content-Length``, bad chunked framing, invalid header bytes. uvicorn then writes a
  plain-text 400 ("Invalid HTTP request received.") and closes the connection; this
  subclass writes the same 400 with the project's JSON error body (``{"error":
  "malformed_request", ...}``) instead.
* **A response head leaves with small first body bytes.** uvicorn writes the head of
  a response as soon as the app starts it, then the body: two writes, so the client is
  woken for a head it cannot use without the body, and (on a shared core) the server
  waits while it parses it. A read-through's first bytes (up to 64 KiB) come right
  after its head. For every request but a PUT (whose transport ``app.connections``
  wraps for its lingering close) the head is held until the first body write; if that
  is at most ``WITH_HEAD_BYTES`` the two leave in one write, as nginx sends a header
  with its body (``tcp_nopush``). A response that ends with no body write (HEAD, an
  empty body) or closes sends its head then.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

MALFORMED_BODY = json.dumps(
    {
        "error": "malformed_request",
        "message": "the HTTP parser refused the request: a malformed request line or target "
        "(raw non-ASCII bytes must be percent-encoded), header or body framing",
        "part": None,
    }
).encode()


class ECHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with this module's two changes."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.scope.get("method") != "PUT":
            cycle = self.cycle
            cycle.transport = _HeadWithBody(self.transport, cycle)  # type: ignore[assignment]

    def send_400_response(self, msg: str) -> None:
        content = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(MALFORMED_BODY)).encode("ascii") + b"\r\n",
                b"connection: close\r\n",
                b"\r\n",
                MALFORMED_BODY,
            ]
        )
        self.transport.write(b"".join(content))
        self.transport.close()


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
