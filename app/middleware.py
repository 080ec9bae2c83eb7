"""The one middleware: admission control, request ids, HTTP metrics and access logs.

Pure ASGI (not ``BaseHTTPMiddleware``) so bodies stream through untouched.
"""

from __future__ import annotations

import logging
import os
import re
import time
from urllib.parse import quote

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.error_responses import json_error
from app.errors import BodyTooLarge
from app.metrics import Metrics
from app.settings import Settings

access_log = logging.getLogger("app.access")

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_TARGET_BYTES = 2048
#: The body of any request but an upload (a PUT to ``/ec/``): JSON that its route reads
#: whole into memory (a batch exists of 1000 hashes of 256 characters is about 260 KB).
MAX_SMALL_BODY_BYTES = 1024 * 1024
#: What an access line leaves unquoted in a path: RFC 3986's path characters. A space,
#: a control character (``%0A`` would start a forged line) or a ``%`` is quoted.
_PATH_SAFE = "/:@!$&'()*+,;=~"


def _refusal(status: int, code: str, message: str, retry_after: int = 0) -> Response:
    """The answer to a request refused before it reached the app (the connection closes)."""
    headers = {"Connection": "close"}
    if retry_after:
        headers["Retry-After"] = str(retry_after)
    return json_error(status, code, message, None, headers)


class EdgeMiddleware:
    """What every request passes through, in one pure-ASGI layer (each layer costs a
    closure and an await per message, and the small requests are measured against a
    raw ASGI floor):

    * admission: oversized headers (431) or targets (414) never reach the app, nor
      does a body other than an upload's past ``MAX_SMALL_BODY_BYTES`` (413, up front
      for its ``Content-Length``, else once that much came in), and entry transfers
      beyond the concurrency caps get 503 + Retry-After, never a queue;
    * a request id (the client's ``X-Request-ID`` when sane), echoed in the response;
    * the ``ec_http_requests_total`` and ``ec_http_request_duration_seconds`` series;
    * one access line when the response is done. Like nginx's
      ``$upstream_cache_status`` it carries the tier that answered an entry read
      (``cache=disk``, ``s3`` or ``miss``; ``-`` for other requests), the body bytes
      sent and received, and the duration.
    """

    def __init__(self, app: ASGIApp, settings: Settings, metrics: Metrics) -> None:
        self.app = app
        self.settings = settings
        self.metrics = metrics
        self.uploads = 0
        self.downloads = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        incoming = ""
        header_bytes = declared = 0
        for name, value in scope["headers"]:
            header_bytes += len(name) + len(value) + 4
            if name == b"x-request-id":
                incoming = value.decode("latin-1")
            elif name == b"content-length":  # checked by the HTTP parser
                declared = int(value)
        upload = scope["method"] == "PUT" and scope["path"].startswith("/ec/")
        body_limit = None if upload else MAX_SMALL_BODY_BYTES
        request_id = incoming if _REQUEST_ID_RE.fullmatch(incoming) else os.urandom(16).hex()
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500
        sent = 0
        received = 0

        async def receive_counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if body_limit is not None and received > body_limit:
                    # An HTTPException, which FastAPI's body parsing lets through (it
                    # turns any other error into a 400), as Starlette's own body limit.
                    raise HTTPException(413, f"request body exceeds {body_limit} bytes")
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
            too_large = body_limit is not None and declared > body_limit
            await self._admit(scope, receive_counted, send_with_id, header_bytes, too_large)
        finally:
            self._record(scope, status, sent, received, time.perf_counter() - start)

    async def _admit(
        self, scope: Scope, receive: Receive, send: Send, header_bytes: int, too_large: bool
    ) -> None:
        settings = self.settings
        if header_bytes > settings.max_header_bytes:
            message = f"request headers exceed {settings.max_header_bytes} bytes"
            await _refusal(431, "headers_too_large", message)(scope, receive, send)
            return
        if len(scope.get("raw_path") or b"") + len(scope["query_string"]) > MAX_TARGET_BYTES:
            message = f"request target exceeds {MAX_TARGET_BYTES} bytes"
            await _refusal(414, "uri_too_long", message)(scope, receive, send)
            return
        if too_large:  # by its Content-Length: refused before any of it is read
            message = f"request body exceeds {MAX_SMALL_BODY_BYTES} bytes"
            await _refusal(413, BodyTooLarge.code, message)(scope, receive, send)
            return
        method = scope["method"]
        if method == "GET" and scope["path"].startswith("/ec/"):
            if self.downloads >= settings.max_concurrent_downloads:
                await _refusal(503, "too_many_downloads", "too many concurrent downloads", 1)(
                    scope, receive, send
                )
                return
            self.downloads += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.downloads -= 1
        elif method == "PUT" and scope["path"].startswith("/ec/"):
            if self.uploads >= settings.max_concurrent_uploads:
                await _refusal(503, "too_many_uploads", "too many concurrent uploads", 1)(
                    scope, receive, send
                )
                return
            self.uploads += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.uploads -= 1
        else:
            await self.app(scope, receive, send)

    def _record(self, scope: Scope, status: int, sent: int, received: int, seconds: float) -> None:
        method = scope["method"]
        self.metrics.request(route_label(method, scope["path"]), method, status, seconds)
        if not access_log.isEnabledFor(logging.INFO):
            return
        path = quote(scope["path"], safe=_PATH_SAFE)  # decoded by uvicorn: quoted again
        cache = scope["state"].get("cache")
        client = scope.get("client")
        request_id = scope["state"]["request_id"]
        duration_ms = seconds * 1e3
        # makeRecord + handle is Logger.info without its caller lookup (a stack walk
        # that names this line in every record, which no format here shows).
        record = access_log.makeRecord(
            access_log.name,
            logging.INFO,
            __file__,
            0,
            "%s %s %d cache=%s %dB %.1fms id=%s",
            (method, path, status, cache or "-", sent, duration_ms, request_id),
            None,
            extra={
                "request_id": request_id,
                "method": method,
                "path": path,
                "status": status,
                "cache": cache,
                "bytes_sent": sent,
                "bytes_received": received,
                "duration_ms": round(duration_ms, 3),
                "client": f"{client[0]}:{client[1]}" if client else None,
            },
        )
        access_log.handle(record)


#: ``POST /ec/{model}/{dtype}/_{name}``: the namespace's batch operations.
BATCH_ROUTES = ("exists", "claim", "release", "wait")


def route_label(method: str, path: str) -> str:
    """A bounded label for a request path (never the key itself)."""
    if path.startswith("/ec/"):
        if method == "POST":
            for batch in BATCH_ROUTES:
                if path.endswith(f"/_{batch}"):
                    return batch
        return "entry"
    if path in ("/healthz", "/readyz", "/metrics", "/stats", "/docs", "/openapi.json"):
        return path[1:]
    if path == "/namespaces" or path.startswith("/namespaces/"):
        return "namespaces"
    return "other"
