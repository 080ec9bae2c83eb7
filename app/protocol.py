"""uvicorn's httptools protocol, with two changes.

* **JSON 400s.** llhttp refuses some requests before the app can see them: raw
  non-ASCII bytes or spaces in the request target, a malformed or repeated
  ``Content-Length``, bad chunked framing, invalid header bytes. uvicorn then writes a
  plain-text 400 ("Invalid HTTP request received.") and closes the connection; this
  subclass writes the same 400 with the project's JSON error body (``{"error":
  "malformed_request", ...}``) instead.
* **The response head leaves with the first body bytes.** uvicorn writes the head of a
  response as soon as the app starts it, then the body: two writes, so the client is
  woken for a head it cannot use without the body, and (on a shared core) the server
  waits while it parses it. For every request but a PUT (whose transport
  ``app.connections`` wraps for its lingering close) the head is held until the first
  body bytes are written in the same loop iteration and leaves with them in one
  ``writev``, as nginx sends a header with its body (``tcp_nopush``); a head with no
  body bytes by the end of that iteration (HEAD, or an app that awaits first) leaves
  on its own.
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


class JSONErrorsHttpToolsProtocol(HttpToolsProtocol):
    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.scope.get("method") != "PUT":
            cycle = self.cycle
            cycle.transport = _HeadWithBody(self.transport, cycle, self.loop)  # type: ignore[assignment]

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


class _HeadWithBody:
    """The transport as a response cycle sees it: the response head (the first write
    once the response started) waits for the first body bytes; see the module
    docstring."""

    __slots__ = ("_cycle", "_head", "_head_seen", "_loop", "_transport")

    def __init__(
        self,
        transport: asyncio.Transport,
        cycle: RequestResponseCycle,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._transport = transport
        self._cycle = cycle
        self._loop = loop
        self._head: bytes | None = None
        self._head_seen = False

    def write(self, data: bytes) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.writelines((head, data))
        elif not self._head_seen and self._cycle.response_started:
            self._head_seen = True
            self._head = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
