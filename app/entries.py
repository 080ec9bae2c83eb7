"""The data plane: HEAD, GET, PUT and DELETE of one entry, and the batch existence
check of a namespace (``POST .../_exists``), ahead of FastAPI.

A 128 KiB GET at the framework floor (a raw ASGI app on the same uvicorn options,
``python -m bench --sections floor``) takes about as long as FastAPI's per-request
machinery alone: dependency solving, then five middleware layers, the router and the
endpoint wrapper. So ``ECApp`` hands entry requests to :class:`EntryRoutes` before
FastAPI sees them: one regex match, then a method that reads what it needs from the
request itself (the key from the path, the token from ``Authorization``, two headers).
The existence check, which vLLM's scheduler makes once a step, is served the same way:
through FastAPI, the framework took two thirds of the server's time for 8 hashes.
Errors become answers through ``app.error_responses``, like every route's; the OpenAPI
operations are declared in ``app.openapi``.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Iterator

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from app import checksum, wire
from app.auth import Authenticator
from app.auth import Scope as AuthScope
from app.claim_routes import ClaimRoutes, ExistsRequest, read_batch, states_document
from app.claims import Claims
from app.error_responses import ec_error_response, internal_error_response
from app.errors import (
    AlreadyExists,
    BodyTooLarge,
    ClientGone,
    ECError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
)
from app.keys import EntryKey, parse_key
from app.responses import EntryResponse
from app.settings import Settings
from app.store import Store
from app.upload_deadlines import with_deadlines

log = logging.getLogger("app")

#: ``/ec/{model}/{dtype}/{hash}``; ``model`` may contain ``/`` (uvicorn decoded ``%2F``).
ENTRY_PATH = re.compile(r"/ec/(?P<model>.*)/(?P<dtype>[^/]+)/(?P<hash>[^/]+)")


class PutResponse(BaseModel):
    created: bool
    size: int
    crc32c: str


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


Handler = Callable[[Request, EntryKey], Awaitable[Response]]
#: A namespace's batch operation: ``POST /ec/{model}/{dtype}/_{name}``.
BatchHandler = Callable[[Request, str, str], Awaitable[Response]]


class EntryRoutes:
    """The four entry methods, ``POST .../_exists`` and the claim operations
    (``app.claim_routes``). :meth:`match` says whether a request is one of them;
    anything else (the other routes) is left to FastAPI."""

    ALLOW = "GET, HEAD, PUT, DELETE"

    def __init__(self, store: Store, authenticator: Authenticator, claims: Claims) -> None:
        self.store = store
        self.settings: Settings = store.settings
        self.authenticator = authenticator
        self.claims = claims
        self.methods: dict[str, tuple[AuthScope, Handler]] = {
            "GET": (AuthScope.READ, self.get),
            "HEAD": (AuthScope.READ, self.head),
            "PUT": (AuthScope.WRITE, self.put),
            "DELETE": (AuthScope.ADMIN, self.delete),
        }
        claim_routes = ClaimRoutes(store, claims, self.settings)
        # Claiming obeys the scope of writing: whoever may not store a key may not
        # make others wait for it.
        self.batches: dict[str, tuple[AuthScope, BatchHandler]] = {
            "_exists": (AuthScope.READ, self.exists),
            "_claim": (AuthScope.WRITE, claim_routes.claim),
            "_release": (AuthScope.WRITE, claim_routes.release),
            "_wait": (AuthScope.READ, claim_routes.wait),
        }
        self._claim_routes = claim_routes

    def match(self, scope: Scope) -> re.Match[str] | None:
        return ENTRY_PATH.fullmatch(scope["path"])

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, path: re.Match[str]
    ) -> None:
        request = Request(scope, receive, send)
        started = False

        async def send_started(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            response = await self._respond(request, path)
        except ECError as exc:
            response = ec_error_response(request, exc, self.store.metrics)
        except Exception:
            log.exception("%s %s failed", scope["method"], scope["path"])
            response = internal_error_response(request)
        try:
            await response(scope, receive, send_started)
        except Exception:
            if started:  # headers are out: uvicorn drops the connection
                raise
            log.exception("%s %s failed", scope["method"], scope["path"])
            await internal_error_response(request)(scope, receive, send)

    async def _respond(self, request: Request, path: re.Match[str]) -> Response:
        model = path["model"]
        authorization = request.headers.get("authorization")
        # Authorization first: an unauthorized client learns nothing, not even that its
        # key is malformed.
        batch = self.batches.get(path["hash"]) if request.method == "POST" else None
        if batch is not None:
            batch_scope, batch_handler = batch
            self.authenticator.authorize(authorization, batch_scope, model)
            return await batch_handler(request, model, path["dtype"])
        method = self.methods.get(request.method)
        if method is None:
            raise MethodNotAllowed(f"{request.method} is not allowed here", allow=self.ALLOW)
        scope, handler = method
        self.authenticator.authorize(authorization, scope, model)
        return await handler(request, parse_key(model, path["dtype"], path["hash"]))

    async def exists(self, request: Request, model: str, dtype: str) -> Response:
        """Which of the hashes in the JSON body are stored (in this namespace), in
        order, and with ``claims`` which absent ones are being computed; a 400 names
        the first invalid hash by its index."""
        asked = await read_batch(request, model, dtype, ExistsRequest)
        if not asked.claims:
            present = await self.store.exists_many(model, dtype, asked.hashes)
            return JSONResponse({"present": present})  # as ExistsResponse describes it
        keys = [EntryKey(model, dtype, digest) for digest in asked.hashes]
        return states_document(*await self._claim_routes.states(keys))

    async def get(self, request: Request, key: EntryKey) -> Response:
        store = self.store
        with _cache_status(request):
            body = await store.get(key)
        request.state.cache = body.info.tier
        if_none_match = request.headers.get("if-none-match")
        if if_none_match is not None and body.info.etag in if_none_match:
            await body.aclose()
            return Response(status_code=304, headers={"ETag": body.info.etag})
        store.metrics.bytes_sent.inc(body.info.size)
        return EntryResponse(body.info, body)

    async def head(self, request: Request, key: EntryKey) -> Response:
        with _cache_status(request):
            info = await self.store.head(key)
        request.state.cache = info.tier
        return EntryResponse(info)

    async def put(self, request: Request, key: EntryKey) -> Response:
        store = self.store
        settings = self.settings
        expected_crc = _parse_crc(request.headers.get("x-ec-crc32c"))
        content_length = _parse_length(request.headers.get("content-length"))
        # Decided before the body is read: with Expect: 100-continue it is never sent.
        if content_length is not None and content_length > settings.max_body_bytes:
            raise BodyTooLarge(
                f"Content-Length {content_length} exceeds the {settings.max_body_bytes}-byte limit"
            )
        if_none_match = request.headers.get("if-none-match")
        checked = if_none_match is not None and if_none_match.strip() == "*"
        if checked and await store.exists(key):
            raise AlreadyExists(f"entry {key} already exists")
        try:
            result = await store.put(
                key,
                with_deadlines(request.stream(), settings),
                declared_length=content_length,
                expected_crc=expected_crc,
                known_absent=checked,
            )
        except ClientDisconnect:
            raise ClientGone("client disconnected before sending the whole body") from None
        request.state.body_consumed = True
        self.claims.settle(key)  # whoever computed it, the key is no longer missing
        crc_hex = checksum.to_hex(result.crc32c)
        return JSONResponse(
            PutResponse(created=result.created, size=result.size, crc32c=crc_hex).model_dump(),
            status_code=201 if result.created else 200,
            headers={"ETag": checksum.etag(result.crc32c), "X-EC-CRC32C": crc_hex},
        )

    async def delete(self, request: Request, key: EntryKey) -> Response:
        await self.store.delete(key)
        return Response(status_code=204)
