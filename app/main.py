"""The application factory: settings in, a ready FastAPI app out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import __version__
from app.api import router
from app.auth import AnonymousAccess, Authenticator, load_tokens
from app.errors import ECError
from app.metrics import Metrics, MetricsMiddleware
from app.middleware import AdmissionMiddleware, RequestContextMiddleware
from app.namespaces_api import router as namespaces_router
from app.settings import Settings
from app.store import Store
from app.tiers.disk import DiskTier
from app.tiers.s3 import S3Backend


def _error(
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


async def _ec_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ECError)
    if request.method == "PUT":
        request.app.state.metrics.rejected_puts.labels(exc.code).inc()
    return _error(request, exc.status_code, exc.code, exc.message, exc.part, exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    part = location[0] if location else None
    message = f"{'.'.join(location) or 'request'}: {first.get('msg', 'invalid request')}"
    return _error(request, 400, "invalid_request", message, part)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    return _error(
        request,
        exc.status_code,
        codes.get(exc.status_code, "http_error"),
        str(exc.detail),
        None,
        dict(exc.headers or {}),
    )


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # A bug, not a client's fault: JSON like every other error (the traceback is logged).
    return _error(
        request, 500, "internal_error", "internal server error (see the server log)", None
    )


class ConfigurationError(Exception):
    """Settings that are valid one by one but not together; start-up stops."""


def _authenticator(settings: Settings) -> Authenticator:
    try:
        tokens = load_tokens(
            settings.auth_tokens.get_secret_value() if settings.auth_tokens else None,
            settings.auth_tokens_file,
        )
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    anonymous = settings.anonymous_access(bool(tokens))
    if not tokens and anonymous is AnonymousAccess.NONE:
        raise ConfigurationError(
            f"listening on {settings.host} with no tokens and no anonymous access: set "
            "EC_AUTH_TOKENS or EC_AUTH_TOKENS_FILE, or EC_ANONYMOUS=read / read-write"
        )
    return Authenticator(tokens, anonymous)


def _s3_backend(settings: Settings, metrics: Metrics) -> S3Backend | None:
    # Settings validated the EC_S3_* values (bucket required with an endpoint).
    if not settings.s3_enabled:
        return None
    return S3Backend.from_settings(settings, registry=metrics.registry)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; tiers are created here and started by the lifespan.

    Raises ``ConfigurationError`` for settings that cannot work together.
    """
    settings = settings or Settings()
    authenticator = _authenticator(settings)
    metrics = Metrics(settings.metrics_namespaces)
    disk = DiskTier(
        settings.data_dir,
        settings.disk_max_bytes,
        commit_delay=settings.disk_commit_delay,
        registry=metrics.registry,
    )
    metrics.watch_disk(disk.stats)
    store = Store(settings, disk, metrics, _s3_backend(settings, metrics))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await store.start()
        try:
            yield
        finally:
            await store.stop()

    app = FastAPI(
        title="ec-cache",
        version=__version__,
        summary="Shared cache for multimodal encoder outputs",
        lifespan=lifespan,
        # Never 307 to the same path with(out) a trailing slash: the Location would be
        # built from the client's Host header. Such paths are 404s like any other.
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.store = store
    app.state.authenticator = authenticator
    app.include_router(router)
    app.include_router(namespaces_router)
    app.add_exception_handler(ECError, _ec_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    # Added last is outermost: ids and access lines cover refusals and metrics too.
    app.add_middleware(AdmissionMiddleware, settings=settings)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(RequestContextMiddleware)
    return app
