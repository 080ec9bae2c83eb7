"""The OpenAPI document: FastAPI's, plus the operations of ``app.entries``.

The entry routes are served ahead of FastAPI (see ``app.entries`` for why), which
therefore does not describe them, so their operations (the four of an entry, and the
batch existence check) are declared here, the way FastAPI's docs extend a schema. The
fuzz tests (``tests/e2e/test_fuzz.py``) run requests generated from this document
against a real server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from app.claim_routes import (
    MAX_BATCH_HASHES,
    ClaimRequest,
    ClaimResponse,
    ExistsRequest,
    ExistsResponse,
    ReleaseRequest,
    ReleaseResponse,
    WaitRequest,
)
from app.entries import PutResponse

ENTRY_DOC = (
    "`model` may contain `/` (plain or `%2F`); `dtype` is a torch dtype name; `hash` is "
    "vLLM's multimodal hash. The body is a single-tensor safetensors file."
)
_ERROR = {"$ref": "#/components/schemas/Error"}
_ERROR_SCHEMA = {
    "title": "Error",
    "type": "object",
    "required": ["error", "message", "part"],
    "properties": {
        "error": {"type": "string", "description": "stable machine code"},
        "message": {"type": "string"},
        "part": {
            "anyOf": [{"type": "string"}, {"type": "null"}],
            "description": "the part of the request that was wrong",
        },
    },
}
_ENTRY_HEADERS = {
    name: {"description": text, "schema": {"type": "string"}}
    for name, text in (
        ("ETag", "the CRC32C of the body, quoted"),
        ("X-EC-CRC32C", "the CRC32C of the body, 8 lowercase hex digits"),
        ("X-EC-Dtype", "the safetensors dtype of the tensor"),
        ("X-EC-Shape", "the tensor's shape, e.g. `576,4096`"),
        ("X-EC-Data-Offset", "where the tensor's bytes start in the body"),
        ("X-EC-Tier", "which tier answered: `disk` or `s3`"),
    )
}


def _parameters(
    *headers: tuple[str, str], path_names: tuple[str, ...] = ("model", "dtype", "hash")
) -> list[dict[str, Any]]:
    path = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in path_names
    ]
    return path + [
        {"name": name, "in": "header", "required": False, "description": text,
         "schema": {"type": "string"}}
        for name, text in headers
    ]  # fmt: skip


def _errors(*statuses: int) -> dict[str, Any]:
    statuses = (400, 401, 403, *statuses)
    return {
        str(status): {
            "description": "error",
            "content": {"application/json": {"schema": _ERROR}},
        }
        for status in statuses
    }


def _operation(summary: str, operation_id: str, **fields: Any) -> dict[str, Any]:
    return {"summary": summary, "description": ENTRY_DOC, "operationId": operation_id, **fields}


def entry_operations() -> dict[str, Any]:
    if_none_match = ("If-None-Match", "an ETag held already: 304 when it matches")
    found = {"description": "the entry", "headers": _ENTRY_HEADERS}
    stored = {
        "headers": {name: _ENTRY_HEADERS[name] for name in ("ETag", "X-EC-CRC32C")},
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/PutResponse"}}},
    }
    return {
        "get": _operation(
            "Read an entry",
            "get_entry",
            parameters=_parameters(if_none_match),
            responses={
                "200": {
                    **found,
                    "content": {"application/octet-stream": {"schema": {"type": "string"}}},
                },
                "304": {"description": "the entry has the ETag given in If-None-Match"},
                **_errors(404, 502, 503),
            },
        ),
        "head": _operation(
            "Describe an entry",
            "head_entry",
            parameters=_parameters(),
            responses={"200": found, **_errors(404, 502, 503)},
        ),
        "put": _operation(
            "Store an entry (first writer wins)",
            "put_entry",
            parameters=_parameters(
                ("If-None-Match", "`*`: 412 without reading the body when the entry exists"),
                ("X-EC-CRC32C", "the body's CRC32C (8 lowercase hex digits), checked"),
            ),
            requestBody={
                "required": True,
                "content": {"application/octet-stream": {"schema": {"type": "string"}}},
            },
            responses={
                "201": {"description": "stored", **stored},
                "200": {"description": "stored already (by the first writer)", **stored},
                **_errors(408, 412, 413, 502, 503, 507),
            },
        ),
        "delete": _operation(
            "Remove an entry from every tier",
            "delete_entry",
            parameters=_parameters(),
            responses={"204": {"description": "removed (or absent)"}, **_errors(502, 503)},
        ),
    }


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}


def _batch_operation(
    summary: str,
    operation_id: str,
    description: str,
    request: type[BaseModel],
    response: type[BaseModel],
    answer: str,
    *statuses: int,
) -> dict[str, Any]:
    """``POST /ec/{model}/{dtype}/_{name}``: up to ``MAX_BATCH_HASHES`` hashes of one
    namespace in, one list per field out, in the order asked."""
    return {
        "post": {
            "summary": summary,
            "description": f"{description} Up to {MAX_BATCH_HASHES} hashes; a 400 names the "
            "first invalid hash by its index.",
            "operationId": operation_id,
            "parameters": _parameters(path_names=("model", "dtype")),
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {"description": answer, "content": _json(response)},
                **_errors(408, 413, 502, *statuses),
            },
        }
    }


def batch_operations() -> dict[str, dict[str, Any]]:
    return {
        "_exists": _batch_operation(
            "Batch existence check",
            "exists_many",
            "Which hashes are stored under `model` and `dtype`, in the order asked. With "
            "`claims: true`, also which absent ones another client has claimed "
            "(`computing`) and how long their leases have left.",
            ExistsRequest,
            ExistsResponse,
            "presence of each hash, in order",
            503,
        ),
        "_claim": _batch_operation(
            "Claim missing keys (encode once per cluster)",
            "claim_many",
            "Claims each absent, unclaimed hash for `owner` for `lease_ms` (capped at "
            "EC_CLAIM_MAX_LEASE): the owner should compute and PUT it, and others asking "
            "learn it is `computing`. A PUT of the key, `_release` or the lease's end ends "
            "the claim. Claims are advisory and held by this replica only. Needs the "
            "write scope.",
            ClaimRequest,
            ClaimResponse,
            "per hash: granted, the key's state, and the lease left when computing",
            503,
        ),
        "_release": _batch_operation(
            "Give up claims",
            "release_many",
            "Ends `owner`'s claims on the hashes (it will not compute them); waiters wake. "
            "Needs the write scope.",
            ReleaseRequest,
            ReleaseResponse,
            "per hash: whether the owner's claim ended",
        ),
        "_wait": _batch_operation(
            "Wait until claimed keys land or their claims end",
            "wait_many",
            "Holds the request until none of the hashes is `computing` (each was stored, "
            "or its claim was released or expired) or `timeout_ms` passes (capped at "
            "EC_CLAIM_MAX_WAIT), then answers as `_exists` with `claims`. 503 when "
            "EC_CLAIM_MAX_WAITERS requests already wait.",
            WaitRequest,
            ExistsResponse,
            "presence and state of each hash, in order",
            503,
        ),
    }


def openapi_builder(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """``app.openapi``: FastAPI's document with the entry paths first; built once."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            schema["paths"] = {
                "/ec/{model}/{dtype}/{hash}": entry_operations(),
                **{
                    f"/ec/{{model}}/{{dtype}}/{name}": operations
                    for name, operations in batch_operations().items()
                },
                **schema["paths"],
            }
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            schemas["Error"] = _ERROR_SCHEMA
            for model in (
                PutResponse,
                ExistsRequest,
                ExistsResponse,
                ClaimRequest,
                ClaimResponse,
                ReleaseRequest,
                ReleaseResponse,
                WaitRequest,
            ):
                schemas[model.__name__] = model.model_json_schema()
            app.openapi_schema = schema
        return app.openapi_schema

    return build
