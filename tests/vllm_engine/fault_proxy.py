"""An HTTP proxy in front of a real ec-cache server that breaks entry GETs on purpose.

The scheduler's ``POST _exists`` always passes through, so vLLM is told "present" and
the failure lands where it hurts: in the worker's load, after scheduling.

Modes (for ``GET /ec/...``):
    ``pass``     forward unchanged
    ``kill``     SIGKILL the upstream server at the first GET, then reset every
                 connection (a dead server)
    ``503``      answer 503 (S3 tier unreachable)
    ``corrupt``  forward with one payload byte flipped (the checksum header kept)
    ``slow``     wait ``delay_s`` before forwarding (past the connector's timeouts)
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        mode: str,
        *,
        on_kill: Callable[[], None] | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.upstream = upstream
        self.mode = mode
        self.on_kill = on_kill
        self.delay_s = delay_s
        self.killed = threading.Event()
        self.seen: Counter[str] = Counter()  # "GET entry", "POST exists", ...
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _count(self, what: str) -> None:
        with self._lock:
            self.seen[what] += 1

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _reset(self) -> None:
                # SO_LINGER 0: close() sends RST, as a peer whose process died would.
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True

            def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    if name.lower() not in _HOP_BY_HOP:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _forward(self) -> tuple[int, dict[str, str], bytes] | None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                try:
                    response = httpx.request(
                        self.command,
                        proxy.upstream + self.path,
                        headers=headers,
                        content=body,
                        timeout=30,
                    )
                except httpx.TransportError:
                    return None
                return response.status_code, dict(response.headers), response.content

            def _handle(self) -> None:
                is_entry_get = (
                    self.command == "GET"
                    and self.path.startswith("/ec/")
                    and not self.path.endswith("/_exists")
                )
                kind = "exists" if self.path.endswith("/_exists") else "entry"
                proxy._count(f"{self.command} {kind}")
                if proxy.killed.is_set():
                    self._reset()
                    return
                if is_entry_get and proxy.mode == "kill":
                    if proxy.on_kill is not None:
                        proxy.on_kill()
                    proxy.killed.set()
                    self._reset()
                    return
                if is_entry_get and proxy.mode == "503":
                    body = b'{"error": {"code": "unavailable", "message": "S3 unreachable"}}'
                    self._send(503, {"Content-Type": "application/json"}, body)
                    return
                if is_entry_get and proxy.mode == "slow":
                    time.sleep(proxy.delay_s)
                answer = self._forward()
                if answer is None:
                    self._reset()
                    return
                status, headers, body = answer
                if is_entry_get and proxy.mode == "corrupt" and status == 200 and body:
                    body = body[:-1] + bytes([body[-1] ^ 0xFF])
                self._send(status, headers, body)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        return Handler
