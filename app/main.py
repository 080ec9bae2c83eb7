"""The application factory: settings in, a ready FastAPI app out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app import __version__
from app.api import router
from app.auth import AnonymousAccess, Authenticator, load_tokens
from app.claims import Claims
from app.entries import EntryRoutes
from app.error_responses import ec_error_response, error_response, internal_error_response
from app.errors import BodyTooLarge, ECError, InvalidRequest
from app.metrics import ClaimMetrics, Metrics
from app.middleware import EdgeMiddleware
from app.namespaces_api import router as namespaces_router
from app.openapi import openapi_builder
from app.settings import Settings, WriteMode
from app.store import Store
from app.tiers.disk import DiskTier
from app.tiers.s3 import S3Backend
from app.write_policy import DiskOnlyPolicy, WriteBackPolicy, WritePolicy, WriteThroughPolicy


async def _ec_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ECError)
    return ec_error_response(request, exc, request.app.state.metrics)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    error = InvalidRequest.from_validation(exc.errors())
    return error_response(request, 400, error.code, error.message, error.part)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not_found", 405: "method_not_allowed", 413: BodyTooLarge.code}
    return error_response(
        request,
        exc.status_code,
        codes.get(exc.status_code, "http_error"),
        str(exc.detail),
        None,
        dict(exc.headers or {}),
    )


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    return internal_error_response(request)


class ECApp(FastAPI):
    """The FastAPI app behind the one middleware (``EdgeMiddleware``), with the entry
    routes served ahead of FastAPI's own routing (see ``app.entries`` for why)."""

    edge: EdgeMiddleware
    entries: EntryRoutes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.edge(scope, receive, send)
        else:  # the lifespan
            await super().__call__(scope, receive, send)

    async def route(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The edge's inner app: an entry request, or FastAPI for everything else."""
        path = self.entries.match(scope)
        if path is None:
            await super().__call__(scope, receive, send)
        else:
            await self.entries(scope, receive, send, path)


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


def _write_policy(
    settings: Settings, disk: DiskTier, s3: S3Backend | None, metrics: Metrics
) -> WritePolicy:
    """The one write policy of this server (``app.write_policy``)."""
    if s3 is None:
        return DiskOnlyPolicy()
    if settings.write_mode is WriteMode.WRITE_BACK:
        return WriteBackPolicy(settings, disk, s3, metrics.registry)
    return WriteThroughPolicy(disk, s3)


def create_app(settings: Settings | None = None) -> ECApp:
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
    metrics.watch_namespaces(disk.holds_namespace, lambda: disk.namespaces()[0])
    s3 = _s3_backend(settings, metrics)
    store = Store(settings, disk, metrics, s3, _write_policy(settings, disk, s3, metrics))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await store.start()
        try:
            yield
        finally:
            await store.stop()

    app = ECApp(
        title="ec-cache",
        version=__version__,
        summary="Shared cache for multimodal encoder outputs",
        lifespan=lifespan,
        # Never 307 to the same path with(out) a trailing slash: the Location would be
        # built from the client's Host header. Such paths are 404s like any other.
        redirect_slashes=False,
        # The app exports Prometheus metrics itself; FastAPI's OpenTelemetry hooks
        # would otherwise look for a configured provider on every request.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.openapi = openapi_builder(app)  # type: ignore[method-assign]
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
    # Outside everything: refusals and errors get an id, a count and an access line too.
    app.edge = EdgeMiddleware(app.route, settings, metrics)
    claims = Claims(
        max_keys=settings.claim_max_keys,
        max_lease=settings.claim_max_lease,
        max_waiters=settings.claim_max_waiters,
        metrics=ClaimMetrics(metrics.registry),
    )
    app.entries = EntryRoutes(store, authenticator, claims)
    return app
