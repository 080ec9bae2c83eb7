"""``POST .../_claim``, ``.../_release`` and ``.../_wait``: claims on missing keys over
HTTP (see ``app.claims``), served with the entry routes ahead of FastAPI
(``app.entries``), like the batch existence check they extend.

Each takes a JSON body naming up to ``MAX_BATCH_HASHES`` hashes of one namespace and
answers one list per field, in the order asked, as ``_exists`` does: an engine asks
about all of a request's items in one round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TypeVar

from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import Receive

from app.claims import ClaimAnswer, Claims
from app.errors import BodyTooLarge, ClientGone, InvalidRequest
from app.keys import HASH_RULE, EntryKey, first_invalid_hash, validate_dtype, validate_model
from app.settings import Settings
from app.store import Store

#: The most hashes one batch request (``_exists``, ``_claim``, ``_release``,
#: ``_wait``) may name.
MAX_BATCH_HASHES = 1000

#: Who claims: any printable ASCII, e.g. an engine's id; only it may release the claim.
OWNER_PATTERN = r"^[!-~]{1,128}$"


class BatchRequest(BaseModel):
    hashes: list[str] = Field(max_length=MAX_BATCH_HASHES)


class ExistsRequest(BatchRequest):
    #: Also say which absent keys are being computed (``state``, ``expires_in_ms``).
    claims: bool = False


class ExistsResponse(BaseModel):
    present: list[bool]
    #: With ``claims``: ``present``, ``absent`` or ``computing`` (claimed by a client).
    state: list[str] | None = None
    #: With ``claims``: for a computing key, the milliseconds left of its claim's lease.
    expires_in_ms: list[int | None] | None = None


class ClaimRequest(BatchRequest):
    owner: str = Field(pattern=OWNER_PATTERN)
    #: How long the claimer expects to encode and upload (capped at EC_CLAIM_MAX_LEASE).
    lease_ms: int = Field(ge=1)


class ClaimResponse(BaseModel):
    #: True where the asker now holds the claim (and should compute and PUT the entry).
    granted: list[bool]
    state: list[str]
    expires_in_ms: list[int | None]


class ReleaseRequest(BatchRequest):
    owner: str = Field(pattern=OWNER_PATTERN)


class ReleaseResponse(BaseModel):
    #: True where the owner's claim ended here (False: it held none, or it had expired).
    released: list[bool]


class WaitRequest(BatchRequest):
    #: Wait at most this long (capped at EC_CLAIM_MAX_WAIT) for every claim to end.
    timeout_ms: int = Field(ge=0)


Body = TypeVar("Body", bound=BatchRequest)


async def read_batch(request: Request, model: str, dtype: str, schema: type[Body]) -> Body:
    """The namespace checked, then the request's JSON body as ``schema`` with every
    hash checked; a 400 names the first invalid hash by its index."""
    validate_model(model)
    validate_dtype(dtype)
    content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if content_type != "application/json" and not content_type.endswith("+json"):
        raise InvalidRequest("the body must be JSON (Content-Type: application/json)")
    try:
        body = await request.body()
    except HTTPException as exc:  # the edge's limit on bodies other than uploads
        raise BodyTooLarge(str(exc.detail)) from None
    except ClientDisconnect:
        raise ClientGone("client disconnected before sending the whole body") from None
    try:
        asked = schema.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidRequest.from_validation(exc.errors()) from None
    index = first_invalid_hash(asked.hashes)
    if index is not None:
        raise InvalidRequest(f"hashes[{index}]: {HASH_RULE}", part="hashes")
    return asked


def _keys(model: str, dtype: str, asked: BatchRequest) -> list[EntryKey]:
    return [EntryKey(model, dtype, digest) for digest in asked.hashes]


def _milliseconds(seconds: float | None) -> int | None:
    return None if seconds is None else max(1, round(seconds * 1000))


def states_document(present: Sequence[bool], answers: Sequence[ClaimAnswer]) -> JSONResponse:
    """``_exists`` with ``claims`` and ``_wait``: presence, state and lease left."""
    return JSONResponse(
        {
            "present": list(present),
            "state": [answer.state.value for answer in answers],
            "expires_in_ms": [_milliseconds(answer.expires_in) for answer in answers],
        }
    )


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ClaimRoutes:
    """The three claim operations of one replica's :class:`Claims`."""

    def __init__(self, store: Store, claims: Claims, settings: Settings) -> None:
        self.store = store
        self.claims = claims
        self.max_wait = settings.claim_max_wait

    async def states(self, keys: Sequence[EntryKey]) -> tuple[list[bool], list[ClaimAnswer]]:
        """Whether the store holds each key of one namespace, and what claims say."""
        if not keys:
            return [], []
        hashes = [key.hash for key in keys]
        present = await self.store.exists_many(keys[0].model, keys[0].dtype, hashes)
        return present, self.claims.states(keys, present)

    async def claim(self, request: Request, model: str, dtype: str) -> JSONResponse:
        """Claim each absent, unclaimed key for the asker; say who computes the rest."""
        asked = await read_batch(request, model, dtype, ClaimRequest)
        keys = _keys(model, dtype, asked)
        present, answers = await self.states(keys)
        # Decided after the await, in one step of the loop: of racing claimers of a
        # key, the first to get here wins.
        granted = [
            self.claims.claim(key, asked.owner, asked.lease_ms / 1000) if not stored else answer
            for key, stored, answer in zip(keys, present, answers, strict=True)
        ]
        return JSONResponse(
            {
                "granted": [answer.granted for answer in granted],
                "state": [answer.state.value for answer in granted],
                "expires_in_ms": [_milliseconds(answer.expires_in) for answer in granted],
            }
        )

    async def release(self, request: Request, model: str, dtype: str) -> JSONResponse:
        """End the owner's claims (it will not compute these keys after all)."""
        asked = await read_batch(request, model, dtype, ReleaseRequest)
        keys = _keys(model, dtype, asked)
        return JSONResponse({"released": [self.claims.release(key, asked.owner) for key in keys]})

    async def wait(self, request: Request, model: str, dtype: str) -> JSONResponse:
        """Hold the request until no named key is being computed (each landed, or its
        claim ended) or the timeout passes; then answer as ``_exists`` with claims. A
        client that goes away ends its wait at once."""
        asked = await read_batch(request, model, dtype, WaitRequest)
        keys = _keys(model, dtype, asked)
        timeout = min(asked.timeout_ms / 1000, self.max_wait)
        waiting = asyncio.ensure_future(self.claims.wait(keys, timeout))
        gone = asyncio.ensure_future(_until_disconnect(request.receive))
        try:
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not waiting.done():
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiting
        if waiting.cancelled():
            raise ClientGone("client disconnected while waiting")
        waiting.result()  # TooManyWaiters
        present, answers = await self.states(keys)
        return states_document(present, answers)
