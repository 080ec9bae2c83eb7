"""HTTP routes: thin functions over the store; errors are mapped in ``main``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from app import checksum, wire
from app.auth import Authenticator, Principal, Scope
from app.errors import (
    AlreadyExists,
    BodyTooLarge,
    ClientGone,
    InvalidKey,
    InvalidRequest,
    NotFound,
    SlowClient,
)
from app.keys import EntryKey, validate_dtype, validate_hash, validate_model
from app.responses import EntryResponse
from app.settings import Settings
from app.store import Store

MAX_EXISTS_HASHES = 1000
ENTRY_PATH = "/ec/{model:path}/{dtype}/{hash}"
ENTRY_DOC = (
    "`model` may contain `/` (plain or `%2F`); `dtype` is a torch dtype name; `hash` is "
    "vLLM's multimodal hash. The body is a single-tensor safetensors file."
)


async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def entry_key(model: str, dtype: str, hash: str) -> EntryKey:
    return EntryKey.parse(model, dtype, hash)


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


async def _with_deadlines(chunks: AsyncIterator[bytes], settings: Settings) -> AsyncIterator[bytes]:
    """Pass an upload's chunks through; raise ``SlowClient`` when the client stalls.

    Three rules, each answered 408 (the store then removes its temp file): no chunk for
    ``EC_BODY_READ_TIMEOUT``; fewer than ``EC_UPLOAD_MIN_RATE`` bytes per second since
    the end of ``EC_UPLOAD_RATE_GRACE`` (so a client trickling a byte a second cannot
    hold an upload slot); the whole body later than ``EC_UPLOAD_TIMEOUT``.
    """
    iterator = aiter(chunks)
    idle = settings.body_read_timeout
    total = settings.upload_timeout
    rate = settings.upload_min_rate
    grace = settings.upload_rate_grace
    # Formatted once: the loop below runs for every chunk of the body.
    idle_reason = f"no body bytes received for {idle:g} s"
    total_reason = f"upload took over {total:g} s"
    rate_reason = f"upload slower than {rate} bytes/s (after a {grace:g} s grace period)"
    start = time.monotonic()
    received = 0
    while True:
        now = time.monotonic() - start
        wait, reason = min((idle, idle_reason), (total - now, total_reason))
        if rate:
            # The moment the average since the grace period falls below the rate.
            wait, reason = min((wait, reason), (grace + received / rate - now, rate_reason))
        with anyio.move_on_after(max(wait, 0)) as scope:
            try:
                chunk = await anext(iterator)
            except StopAsyncIteration:
                return
        if scope.cancelled_caught:
            raise SlowClient(f"{reason}: {received} bytes in {time.monotonic() - start:.1f} s")
        received += len(chunk)
        yield chunk


CanRead = Depends(Require(Scope.READ))
CanWrite = Depends(Require(Scope.WRITE))
IsAdmin = Depends(Require(Scope.ADMIN))
StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
KeyDep = Annotated[EntryKey, Depends(entry_key)]
# Dependencies are coroutines on purpose: FastAPI runs plain ``def`` ones in a thread
# pool, one thread hop each per request.

router = APIRouter(redirect_slashes=False)


class ExistsRequest(BaseModel):
    hashes: list[str] = Field(max_length=MAX_EXISTS_HASHES)


class ExistsResponse(BaseModel):
    present: list[bool]


class PutResponse(BaseModel):
    created: bool
    size: int
    crc32c: str


def _parse_crc(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return checksum.from_hex(value)
    except ValueError:
        raise InvalidRequest(
            f"X-EC-CRC32C {value[:40]!r} is not 8 lowercase hex digits", part="checksum"
        ) from None


def _parse_length(value: str | None) -> int | None:
    """Content-Length: the HTTP parser checks it too; the app does not rely on that."""
    if value is None:
        return None
    try:
        return wire.decimal(value)
    except ValueError:
        raise InvalidRequest(
            f"Content-Length {value[:40]!r} is not a decimal number of bytes", part="header"
        ) from None


@contextlib.contextmanager
def _cache_status(request: Request) -> Iterator[None]:
    """Record a miss for the access log (``cache=``) when the lookup raises NotFound."""
    try:
        yield
    except NotFound:
        request.state.cache = "miss"
        raise


@router.get(
    ENTRY_PATH,
    dependencies=[CanRead],
    summary="Read an entry",
    description=ENTRY_DOC,
    response_class=Response,
    responses={404: {}, 503: {}},
)
async def get_entry(
    key: KeyDep,
    request: Request,
    store: StoreDep,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    with _cache_status(request):
        body = await store.get(key)
    request.state.cache = body.info.tier
    if if_none_match is not None and body.info.etag in if_none_match:
        await body.aclose()
        return Response(status_code=304, headers={"ETag": body.info.etag})
    store.metrics.bytes_sent.inc(body.info.size)
    return EntryResponse(body.info, body)


@router.head(
    ENTRY_PATH,
    dependencies=[CanRead],
    summary="Describe an entry",
    description=ENTRY_DOC,
    response_class=Response,
    responses={404: {}, 503: {}},
)
async def head_entry(key: KeyDep, request: Request, store: StoreDep) -> Response:
    with _cache_status(request):
        info = await store.head(key)
    request.state.cache = info.tier
    return EntryResponse(info)


@router.put(
    ENTRY_PATH,
    dependencies=[CanWrite],
    summary="Store an entry (first writer wins)",
    description=ENTRY_DOC,
    status_code=201,
    response_model=PutResponse,
    responses={200: {"model": PutResponse}, 412: {}, 413: {}},
)
async def put_entry(
    key: KeyDep,
    request: Request,
    store: StoreDep,
    settings: SettingsDep,
    if_none_match: Annotated[str | None, Header()] = None,
    x_ec_crc32c: Annotated[str | None, Header()] = None,
) -> Response:
    expected_crc = _parse_crc(x_ec_crc32c)
    # Read directly, not as a declared parameter: the HTTP server already validated it.
    length_header = request.headers.get("content-length")
    content_length = _parse_length(length_header)
    # Decided before the body is read: with Expect: 100-continue it is never sent.
    if content_length is not None and content_length > settings.max_body_bytes:
        raise BodyTooLarge(
            f"Content-Length {content_length} exceeds the {settings.max_body_bytes}-byte limit"
        )
    checked = if_none_match is not None and if_none_match.strip() == "*"
    if checked and await store.exists(key):
        raise AlreadyExists(f"entry {key} already exists")
    try:
        result = await store.put(
            key,
            _with_deadlines(request.stream(), settings),
            declared_length=content_length,
            expected_crc=expected_crc,
            known_absent=checked,
        )
    except ClientDisconnect:
        raise ClientGone("client disconnected before sending the whole body") from None
    request.state.body_consumed = True
    crc_hex = checksum.to_hex(result.crc32c)
    return JSONResponse(
        PutResponse(created=result.created, size=result.size, crc32c=crc_hex).model_dump(),
        status_code=201 if result.created else 200,
        headers={"ETag": checksum.etag(result.crc32c), "X-EC-CRC32C": crc_hex},
    )


@router.delete(
    ENTRY_PATH,
    dependencies=[IsAdmin],
    summary="Remove an entry from every tier",
    status_code=204,
    response_class=Response,
)
async def delete_entry(key: KeyDep, store: StoreDep) -> Response:
    await store.delete(key)
    return Response(status_code=204)


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
    for index, value in enumerate(request_body.hashes):
        try:
            validate_hash(value)
        except InvalidKey as exc:
            raise InvalidRequest(f"hashes[{index}]: {exc.message}", part="hashes") from None
    return ExistsResponse(present=await store.exists_many(model, dtype, request_body.hashes))


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
