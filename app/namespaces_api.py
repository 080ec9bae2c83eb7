"""Namespace routes: usage, entries page by page, purge (see ``app.namespaces``).

Models are query parameters (or a JSON body), not path segments, so no model name can
be mistaken for a route. Tokens limited to some models (``model=`` items, see
``app.auth``) see only their namespaces and may purge only those.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator

from app import wire
from app.api import Require, StoreDep
from app.auth import Principal, Scope
from app.keys import validate_dtype, validate_model

MAX_PAGE = 1000

router = APIRouter(prefix="/namespaces", tags=["namespaces"], redirect_slashes=False)


def _decimal(value: object) -> object:
    """Query integers: ASCII digits only (pydantic alone takes ``+5``, `` 5``, ``5_0``)."""
    return wire.decimal(value) if isinstance(value, str) else value


Reader = Annotated[Principal, Depends(Require(Scope.READ))]
Admin = Annotated[Principal, Depends(Require(Scope.ADMIN))]


@router.get("", summary="Namespaces (model, dtype) on this replica's disk: entries and bytes")
async def list_namespaces(store: StoreDep, principal: Reader) -> dict[str, Any]:
    usage, unattributed = store.namespace_usage()
    stats = store.disk_stats()
    result: dict[str, Any] = {
        "namespaces": [
            {"model": u.model, "dtype": u.dtype, "entries": u.entries, "bytes": u.bytes}
            for u in usage
            if u.model is not None and principal.may_access(u.model)
        ],
        "purging": [
            {"model": job.model, "dtype": job.dtype}
            for job in store.purge_jobs()
            if job.state == "running" and principal.may_access(job.model)
        ],
    }
    if principal.unrestricted:
        result["unattributed"] = {"entries": unattributed.entries, "bytes": unattributed.bytes}
        result["disk"] = {
            "entries": stats.entries,
            "used_bytes": stats.used_bytes,
            "max_bytes": stats.max_bytes,
        }
    return result


@router.get("/entries", summary="A namespace's entries, page by page, from disk or S3")
async def list_entries(
    store: StoreDep,
    principal: Reader,
    model: Annotated[str, Query(description="model name, slashes allowed")],
    dtype: Annotated[str, Query()],
    tier: Annotated[Literal["disk", "s3"], Query()] = "disk",
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE), BeforeValidator(_decimal)] = 100,
    after: Annotated[str | None, Query(description="the `next` of the previous page")] = None,
) -> dict[str, Any]:
    validate_model(model)
    validate_dtype(dtype)
    principal.check_model(model)
    entries, cursor = await store.list_namespace(model, dtype, tier, after, limit)
    return {"model": model, "dtype": dtype, "tier": tier, "entries": entries, "next": cursor}


class PurgeRequest(BaseModel):
    model: str
    #: None: every dtype of the model.
    dtype: str | None = None


@router.post(
    "/purge",
    summary="Purge a model's namespace(s) from this replica's disk and from S3",
    status_code=202,
    responses={200: {"description": "a purge of it is already running"}},
)
async def purge(request_body: PurgeRequest, store: StoreDep, principal: Admin) -> Response:
    validate_model(request_body.model)
    if request_body.dtype is not None:
        validate_dtype(request_body.dtype)
    principal.check_model(request_body.model)
    job, started = await store.purge(request_body.model, request_body.dtype)
    return JSONResponse({"purge": job.public()}, status_code=202 if started else 200)


@router.get("/purges", summary="Purges running and recently finished, with their progress")
async def purges(
    store: StoreDep,
    principal: Reader,
    model: Annotated[str | None, Query()] = None,
) -> dict[str, Any]:
    return {
        "purges": [
            job.public()
            for job in store.purge_jobs()
            if principal.may_access(job.model) and (model is None or job.model == model)
        ]
    }
