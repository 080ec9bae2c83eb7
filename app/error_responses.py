"""Errors as HTTP answers: the one place an error's JSON body is made
(``{"error": code, "message": ..., "part": ...}``, :func:`error_document`), and the
answers that carry it: for the FastAPI routes' exception handlers (``app.main``) and the
entry routes (``app.entries``), for the edge middleware's refusals (``app.middleware``),
and as raw bytes for the HTTP protocol, which answers before a request reaches the app
(``app.http_protocol``)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from http import HTTPStatus

from starlette.requests import Request
from starlette.responses import Response

from app.errors import ECError
from app.metrics import Metrics

JSON_MEDIA_TYPE = "application/json"
#: A HEAD answer's error, ``code: message``, since it carries no body (``curl -I``, the SDK).
ERROR_HEADER = "X-EC-Error"


def error_document(code: str, message: str, part: str | None = None) -> bytes:
    """The JSON body of every error answer, encoded as Starlette's ``JSONResponse``
    encodes JSON."""
    return json.dumps(
        {"error": code, "message": message, "part": part},
        ensure_ascii=False,
        separators=(",", ":"),
    ).encode("utf-8")


def json_error(
    status: int,
    code: str,
    message: str,
    part: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """An error answer as an ASGI response."""
    return Response(
        error_document(code, message, part),
        status_code=status,
        headers=dict(headers or {}),
        media_type=JSON_MEDIA_TYPE,
    )


def error_response(
    request: Request,
    status: int,
    code: str,
    message: str,
    part: str | None,
    headers: dict[str, str] | None = None,
) -> Response:
    """The answer to ``request`` for an error."""
    headers = dict(headers or {})
    # An error answered before a PUT body was read leaves unread bytes on the wire:
    # close the connection rather than parse them as the next request.
    if request.method in ("PUT", "POST") and not getattr(request.state, "body_consumed", False):
        headers["Connection"] = "close"
    if request.method == "HEAD":
        text = f"{code}: {message}"[:1000].encode("ascii", "backslashreplace").decode("ascii")
        headers[ERROR_HEADER] = "".join(c if c.isprintable() else " " for c in text)
    return json_error(status, code, message, part, headers)


def ec_error_response(request: Request, exc: ECError, metrics: Metrics) -> Response:
    if request.method == "PUT":
        metrics.rejected_puts.labels(exc.code).inc()
    return error_response(request, exc.status_code, exc.code, exc.message, exc.part, exc.headers)


def internal_error_response(request: Request) -> Response:
    # A bug, not a client's fault: JSON like every other error (the traceback is logged).
    return error_response(
        request, 500, "internal_error", "internal server error (see the server log)", None
    )


def raw_error_response(
    status: int, code: str, message: str, headers: Iterable[tuple[bytes, bytes]] = ()
) -> bytes:
    """A whole HTTP/1.1 error answer, ``Connection: close``, as the bytes a protocol
    writes to its transport (no request, so no ``part``); ``headers`` go first."""
    body = error_document(code, message)
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode("ascii")]
    lines += [name + b": " + value + b"\r\n" for name, value in headers]
    lines += [
        b"content-type: " + JSON_MEDIA_TYPE.encode("ascii") + b"\r\n",
        b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
        b"connection: close\r\n\r\n",
        body,
    ]
    return b"".join(lines)
