"""``POST .../_exists``: many keys' existence in one request per replica and per
``EXISTS_BATCH`` keys, its body, and the reading of its answer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import httpx

from ._exceptions import ConnectError, TransportError

EXISTS_BATCH = 1000


def exists_batches(
    orders: Sequence[Sequence[str]], pending: Iterable[int], dead: set[str]
) -> list[tuple[str, list[int]]]:
    """Group keys (by index) under the first replica of their own order that is not
    ``dead``, in batches of at most ``EXISTS_BATCH``; a key with no live replica left
    raises ``ConnectError``."""
    groups: dict[str, list[int]] = {}
    for i in pending:
        order = orders[i]
        url = order[0]
        if url in dead:
            live = next((u for u in order if u not in dead), None)
            if live is None:
                raise ConnectError(f"no replica reachable: {', '.join(sorted(dead))}", url=url)
            url = live
        groups.setdefault(url, []).append(i)
    return [
        (url, indices[start : start + EXISTS_BATCH])
        for url, indices in groups.items()
        for start in range(0, len(indices), EXISTS_BATCH)
    ]


def exists_body(hashes: Sequence[str]) -> tuple[httpx.ByteStream, dict[str, str]]:
    """The body of ``POST .../_exists`` for checked ``hashes`` and its headers
    (re-iterable, for a resend). A checked hash (letters, digits, ``. _ : -``) is its own
    JSON string, so the list is joined rather than encoded (json.dumps escapes every
    character: 0.18 ms for 1000 hashes)."""
    listed = '","'.join(hashes).join(('["', '"]')) if hashes else "[]"
    content = f'{{"hashes":{listed}}}'.encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(content))}
    return httpx.ByteStream(content), headers


def present_list(answer: Any, count: int, url: str) -> list[bool]:
    """The ``present`` list of an ``_exists`` answer: ``count`` JSON booleans, or a
    ``TransportError`` (never a string or number taken for a boolean)."""
    present = answer.get("present") if isinstance(answer, dict) else None
    if (
        not isinstance(present, list)
        or len(present) != count
        or not all(type(value) is bool for value in present)
    ):
        raise TransportError(f"{url}: malformed _exists answer", url=url)
    return present
