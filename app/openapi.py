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

from app.entries import MAX_EXISTS_HASHES, ExistsRequest, ExistsResponse, PutResponse

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


def exists_operations() -> dict[str, Any]:
    return {
        "post": {
            "summary": "Batch existence check",
            "description": f"Which of up to {MAX_EXISTS_HASHES} hashes are stored under "
            "`model` and `dtype`, in the order asked; a 400 names the first invalid hash "
            "by its index.",
            "operationId": "exists_many",
            "parameters": _parameters(path_names=("model", "dtype")),
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ExistsRequest"}}
                },
            },
            "responses": {
                "200": {
                    "description": "presence of each hash, in order",
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/ExistsResponse"}
                        }
                    },
                },
                **_errors(408, 413, 502, 503),
            },
        }
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
                "/ec/{model}/{dtype}/_exists": exists_operations(),
                **schema["paths"],
            }
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            schemas["Error"] = _ERROR_SCHEMA
            for model in (PutResponse, ExistsRequest, ExistsResponse):
                schemas[model.__name__] = model.model_json_schema()
            app.openapi_schema = schema
        return app.openapi_schema

    return build
