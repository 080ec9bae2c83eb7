"""An HTTP proxy in front of a real ec-cache server that breaks requests on purpose.

Entry GETs (``mode``):
    ``pass``     forward unchanged
    ``kill``     SIGKILL the upstream server at the first GET, then reset every
                 connection (a dead server)
    ``reset``    reset the connection (the server stays up)
    ``503``      answer 503 (S3 tier unreachable)
    ``corrupt``  forward with one payload byte flipped (the checksum header kept)
    ``slow``     wait ``delay_s`` before forwarding (held back, or past a timeout)

``POST _exists`` passes unchanged after ``exists_delay_s`` (so by default vLLM is told
"present" and a failure lands where it hurts: in the worker's load). Another process
(a vLLM engine under test) changes the settings with ``POST /_fault`` and a JSON
object of them; the proxy counts every request it sees in ``seen``.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}
MODES = ("pass", "kill", "reset", "503", "corrupt", "slow")
CONTROL_PATH = "/_fault"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up on a held answer (its timeout is what is tested).
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


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
        self.upstream = upstream
        self.on_kill = on_kill
        self.configure(mode=mode, delay_s=delay_s, exists_delay_s=exists_delay_s)
        self.killed = threading.Event()
        self.seen: Counter[str] = Counter()  # "GET entry", "POST exists", ...
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

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

            def _body(self) -> bytes:
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _forward(self, body: bytes) -> tuple[int, dict[str, str], bytes] | None:
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

            def _control(self, body: bytes) -> None:
                try:
                    proxy.configure(**json.loads(body or b"{}"))
                except (ValueError, TypeError) as exc:
                    self._send(400, {"Content-Type": "text/plain"}, str(exc).encode())
                    return
                self._send(204, {}, b"")

            def _handle(self) -> None:
                body = self._body()
                if self.command == "POST" and self.path == CONTROL_PATH:
                    self._control(body)
                    return
                is_exists = self.path.endswith("/_exists")
                is_entry_get = (
                    self.command == "GET" and self.path.startswith("/ec/") and not is_exists
                )
                proxy._count(f"{self.command} {'exists' if is_exists else 'entry'}")
                if proxy.killed.is_set():
                    self._reset()
                    return
                if is_exists and proxy.exists_delay_s:
                    time.sleep(proxy.exists_delay_s)
                mode = proxy.mode if is_entry_get else "pass"
                if mode == "kill":
                    if proxy.on_kill is not None:
                        proxy.on_kill()
                    proxy.killed.set()
                    self._reset()
                    return
                if mode == "reset":
                    self._reset()
                    return
                if mode == "503":
                    error = b'{"error": {"code": "unavailable", "message": "S3 unreachable"}}'
                    self._send(503, {"Content-Type": "application/json"}, error)
                    return
                if mode == "slow":
                    time.sleep(proxy.delay_s)
                answer = self._forward(body)
                if answer is None:
                    self._reset()
                    return
                status, headers, content = answer
                if mode == "corrupt" and status == 200 and content:
                    content = content[:-1] + bytes([content[-1] ^ 0xFF])
                self._send(status, headers, content)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        return Handler
