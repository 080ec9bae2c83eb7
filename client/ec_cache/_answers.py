"""What the clients read out of answers other than a tensor body: a ``HEAD``'s
:class:`~ec_cache.EntryInfo`, and a JSON body."""

from __future__ import annotations

import json
from typing import Any

import httpx

from ._exceptions import IntegrityError, TransportError
from ._tensors import EntryInfo, parse_shape


def entry_info(hash: str, resp: httpx.Response, url: str) -> EntryInfo:
    """The entry a ``HEAD`` answered 200 for, from its ``X-EC-*`` headers."""
    h = resp.headers
    try:
        shape = parse_shape(h.get("x-ec-shape", ""))
        size = int(h.get("content-length", "0"))
    except ValueError as exc:
        raise IntegrityError(f"bad X-EC-Shape/Content-Length from {url}: {exc}") from None
    return EntryInfo(
        hash=hash,
        dtype=h.get("x-ec-dtype", ""),
        shape=shape,
        size=size,
        crc32c=h.get("x-ec-crc32c"),
        tier=h.get("x-ec-tier"),
        url=url,
    )


def json_body(resp_content: bytes, url: str) -> Any:
    """The answer's JSON; a ``TransportError`` for anything else (deep nesting too)."""
    try:
        return json.loads(resp_content)
    except (ValueError, RecursionError):
        raise TransportError(f"{url}: answer is not JSON", url=url) from None
