"""FastAPI routes besides the entries (``app.entries``): batch existence, health,
readiness, metrics and stats; thin functions over the store, errors mapped in ``main``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from app.auth import Authenticator, Principal, Scope
from app.errors import InvalidRequest
from app.keys import HASH_RULE, first_invalid_hash, validate_dtype, validate_model
from app.store import Store

MAX_EXISTS_HASHES = 1000


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


class ExistsRequest(BaseModel):
    hashes: list[str] = Field(max_length=MAX_EXISTS_HASHES)


class ExistsResponse(BaseModel):
    present: list[bool]


@router.post(
    "/ec/{model:path}/{dtype}/_exists",
    dependencies=[CanRead],
    summary="Batch existence check",
    response_model=ExistsResponse,
)
async def exists_many(
    model: str, dtype: str, request_body: ExistsRequest, store: StoreDep
) -> ExistsResponse:
    validate_model(model)
    validate_dtype(dtype)
    hashes = request_body.hashes
    index = first_invalid_hash(hashes)
    if index is not None:
        raise InvalidRequest(f"hashes[{index}]: {HASH_RULE}", part="hashes")
    return ExistsResponse(present=await store.exists_many(model, dtype, hashes))


@router.api_route("/healthz", methods=["GET", "HEAD"], summary="Liveness")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


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
