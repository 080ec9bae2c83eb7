"""Pure ASGI middleware: admission control, request ids and access logs.

Pure ASGI (not ``BaseHTTPMiddleware``) so bodies stream through untouched.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.settings import Settings

access_log = logging.getLogger("app.access")

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_TARGET_BYTES = 2048


async def _reject(send: Send, status: int, code: str, message: str, retry_after: int = 0) -> None:
    body = json.dumps({"error": code, "message": message, "part": None}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if retry_after:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AdmissionMiddleware:
    """Refuses what must not reach the app: oversized headers or targets, and entry
    transfers beyond the concurrency caps (503 + Retry-After, never a queue)."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.uploads = 0
        self.downloads = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if header_bytes > self.settings.max_header_bytes:
            await _reject(
                send,
                431,
                "headers_too_large",
                f"request headers exceed {self.settings.max_header_bytes} bytes",
            )
            return
        if (
            len(scope.get("raw_path") or b"") + len(scope.get("query_string", b""))
            > MAX_TARGET_BYTES
        ):
            await _reject(
                send, 414, "uri_too_long", f"request target exceeds {MAX_TARGET_BYTES} bytes"
            )
            return
        method = scope["method"]
        if not scope["path"].startswith("/ec/") or method not in ("PUT", "GET"):
            await self.app(scope, receive, send)
            return
        if method == "PUT":
            if self.uploads >= self.settings.max_concurrent_uploads:
                await _reject(send, 503, "too_many_uploads", "too many concurrent uploads", 1)
                return
            self.uploads += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.uploads -= 1
        else:
            if self.downloads >= self.settings.max_concurrent_downloads:
                await _reject(send, 503, "too_many_downloads", "too many concurrent downloads", 1)
                return
            self.downloads += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.downloads -= 1


class RequestContextMiddleware:
    """Gives every request an id (the client's ``X-Request-ID`` when sane), echoes it
    in the response and writes one access line when the response is done.

    The line carries, like nginx's ``$upstream_cache_status``, the tier that answered an
    entry read (``cache=disk``, ``s3`` or ``miss``; ``-`` for other requests), the body
    bytes sent and received, and the duration."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming if _REQUEST_ID_RE.fullmatch(incoming) else os.urandom(16).hex()
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status = 0
        sent = 0
        received = 0

        async def receive_counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive_counted, send_with_id)
        finally:
            client = scope.get("client")
            cache = scope["state"].get("cache")
            duration_ms = (time.perf_counter() - start) * 1e3
            access_log.info(
                "%s %s %d cache=%s %dB %.1fms id=%s",
                scope["method"],
                scope["path"],
                status,
                cache or "-",
                sent,
                duration_ms,
                request_id,
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "path": scope["path"],
                    "status": status,
                    "cache": cache,
                    "bytes_sent": sent,
                    "bytes_received": received,
                    "duration_ms": round(duration_ms, 3),
                    "client": f"{client[0]}:{client[1]}" if client else None,
                },
            )
