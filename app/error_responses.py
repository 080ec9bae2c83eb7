"""Errors as HTTP answers: the one place an error becomes a status, headers and JSON
(``{"error": code, "message": ..., "part": ...}``), for the FastAPI routes' exception
handlers (``app.main``) and the entry routes (``app.entries``) alike."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from app.errors import ECError
from app.metrics import Metrics


def error_response(
    request: Request,
    status: int,
    code: str,
    message: str,
    part: str | None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    headers = dict(headers or {})
    # An error answered before a PUT body was read leaves unread bytes on the wire:
    # close the connection rather than parse them as the next request.
    if request.method in ("PUT", "POST") and not getattr(request.state, "body_consumed", False):
        headers["Connection"] = "close"
    return JSONResponse(
        {"error": code, "message": message, "part": part}, status_code=status, headers=headers
    )


def ec_error_response(request: Request, exc: ECError, metrics: Metrics) -> JSONResponse:
    if request.method == "PUT":
        metrics.rejected_puts.labels(exc.code).inc()
    return error_response(request, exc.status_code, exc.code, exc.message, exc.part, exc.headers)


def internal_error_response(request: Request) -> JSONResponse:
    # A bug, not a client's fault: JSON like every other error (the traceback is logged).
    return error_response(
        request, 500, "internal_error", "internal server error (see the server log)", None
    )
