"""The data plane: HEAD, GET, PUT and DELETE of one entry, as a plain Starlette route.

FastAPI's per-request dependency solving costs more than a whole 128 KiB GET at the
framework floor (``python -m bench --sections floor``), so these four methods read what
they need from the request themselves: the key from the path, the token from
``Authorization``, two headers. Errors are raised as ``ECError``s and mapped to HTTP by
the app's one handler, like every other route's; the OpenAPI operations are declared in
``app.openapi``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator

import anyio
from pydantic import BaseModel
from starlette.endpoints import HTTPEndpoint
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from app import checksum, wire
from app.auth import Authenticator, Scope
from app.errors import (
    AlreadyExists,
    BodyTooLarge,
    ClientGone,
    InvalidRequest,
    NotFound,
    SlowClient,
)
from app.keys import EntryKey
from app.responses import EntryResponse
from app.settings import Settings
from app.store import Store

ENTRY_PATH = "/ec/{model:path}/{dtype}/{hash}"


class PutResponse(BaseModel):
    created: bool
    size: int
    crc32c: str


def _authorized_key(request: Request, scope: Scope) -> EntryKey:
    """The request's key, once its token (or anonymous access) holds ``scope`` for the
    key's model (see ``app.auth``). Authorization comes first: an unauthorized client
    learns nothing, not even that its key is malformed."""
    params = request.path_params
    authenticator: Authenticator = request.app.state.authenticator
    authenticator.authorize(request.headers.get("authorization"), scope, params["model"])
    return EntryKey.parse(params["model"], params["dtype"], params["hash"])


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


@contextlib.contextmanager
def _cache_status(request: Request) -> Iterator[None]:
    """Record a miss for the access log (``cache=``) when the lookup raises NotFound."""
    try:
        yield
    except NotFound:
        request.state.cache = "miss"
        raise


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


class Entry(HTTPEndpoint):
    """``/ec/{model}/{dtype}/{hash}``: one method each."""

    async def get(self, request: Request) -> Response:
        key = _authorized_key(request, Scope.READ)
        store = _store(request)
        with _cache_status(request):
            body = await store.get(key)
        request.state.cache = body.info.tier
        if_none_match = request.headers.get("if-none-match")
        if if_none_match is not None and body.info.etag in if_none_match:
            await body.aclose()
            return Response(status_code=304, headers={"ETag": body.info.etag})
        store.metrics.bytes_sent.inc(body.info.size)
        return EntryResponse(body.info, body)

    async def head(self, request: Request) -> Response:
        key = _authorized_key(request, Scope.READ)
        with _cache_status(request):
            info = await _store(request).head(key)
        request.state.cache = info.tier
        return EntryResponse(info)

    async def put(self, request: Request) -> Response:
        key = _authorized_key(request, Scope.WRITE)
        store = _store(request)
        settings = store.settings
        expected_crc = _parse_crc(request.headers.get("x-ec-crc32c"))
        content_length = _parse_length(request.headers.get("content-length"))
        # Decided before the body is read: with Expect: 100-continue it is never sent.
        if content_length is not None and content_length > settings.max_body_bytes:
            raise BodyTooLarge(
                f"Content-Length {content_length} exceeds the {settings.max_body_bytes}-byte limit"
            )
        if_none_match = request.headers.get("if-none-match")
        if if_none_match is not None and if_none_match.strip() == "*" and await store.exists(key):
            raise AlreadyExists(f"entry {key} already exists")
        try:
            result = await store.put(
                key,
                _with_deadlines(request.stream(), settings),
                declared_length=content_length,
                expected_crc=expected_crc,
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

    async def delete(self, request: Request) -> Response:
        key = _authorized_key(request, Scope.ADMIN)
        await _store(request).delete(key)
        return Response(status_code=204)


# Named methods only: a POST to ``.../_exists`` must fall through to its own route.
routes: list[BaseRoute] = [Route(ENTRY_PATH, Entry, methods=["GET", "HEAD", "PUT", "DELETE"])]
