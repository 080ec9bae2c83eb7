"""FastAPI routes besides the entries and the batch existence check (``app.entries``):
health, readiness, metrics and stats; thin functions over the store, errors mapped in
``main``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from app import __version__
from app.auth import Authenticator, Principal, Scope
from app.store import Store


async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


class Require:
    """Dependency: the request's bearer token (or anonymous access) has ``scope`` and,
    on routes with a ``{model}`` in the path, may touch that model (see ``app.auth``)."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope

    async def __call__(self, request: Request) -> Principal:
        authenticator: Authenticator = request.app.state.authenticator
        return authenticator.authorize(
            request.headers.get("authorization"), self.scope, request.path_params.get("model")
        )


async def metrics_access(request: Request) -> None:
    if not request.app.state.settings.metrics_public:
        (await Require(Scope.READ)(request)).check_unrestricted("/metrics")


CanRead = Depends(Require(Scope.READ))
StoreDep = Annotated[Store, Depends(get_store)]
# Dependencies are coroutines on purpose: FastAPI runs plain ``def`` ones in a thread
# pool, one thread hop each per request.

router = APIRouter(redirect_slashes=False)


@router.api_route("/healthz", methods=["GET", "HEAD"], summary="Liveness, and the version")
async def healthz() -> dict[str, str]:
    return {"status": "ok", "version": __version__}


@router.api_route(
    "/readyz",
    methods=["GET", "HEAD"],
    summary="Readiness: disk writable, S3 reachable when configured",
)
async def readyz(store: StoreDep) -> JSONResponse:
    checks = await store.readiness()
    ready = all(result == "ok" for result in checks.values())
    return JSONResponse(
        {"status": "ready" if ready else "not ready", "checks": checks},
        status_code=200 if ready else 503,
    )


@router.get(
    "/metrics",
    dependencies=[Depends(metrics_access)],
    summary="Prometheus metrics (public unless EC_METRICS_PUBLIC=false)",
    response_class=PlainTextResponse,
)
async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/stats", summary="Summary for operators")
async def stats(store: StoreDep, principal: Annotated[Principal, CanRead]) -> dict[str, Any]:
    principal.check_unrestricted("/stats")
    return store.stats()
