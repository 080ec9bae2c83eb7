"""Claims on missing keys (``POST .../_claim``, ``_release``, ``_wait`` and ``_exists``
with ``claims``): the bodies the clients send and the reading of the answers.

One engine that misses claims a key, computes the entry and PUTs it; the others learn
that it is being computed and wait for it instead of computing it too (the server's
docs/http-api.md, *Claims*). Claims are advisory: every failure to claim or wait ends in
computing the entry, as without claims.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from ._exceptions import TransportError

KeyState = Literal["present", "absent", "computing"]
_STATES = ("present", "absent", "computing")


@dataclass(frozen=True)
class KeyStatus:
    """What the key's replica says of a key: ``present`` (stored: get it), ``absent``
    (nobody computes it), or ``computing`` (claimed by another client, whose lease has
    ``expires_in`` seconds left). ``granted`` is true where a claim made the asker the
    one to compute it."""

    state: KeyState
    granted: bool = False
    expires_in: float | None = None


#: What a client learns when its replica cannot answer (503, unless it raises): the
#: key is treated as absent and unclaimed, so the caller computes it.
UNKNOWN = KeyStatus("absent")


def default_owner() -> str:
    """A claimer id unique to this client: host, process and a random part."""
    host = socket.gethostname().encode("ascii", "replace").decode()[:64]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}".replace(" ", "_")


def batch_body(document: dict[str, Any]) -> tuple[httpx.ByteStream, dict[str, str]]:
    """A JSON body for one of a namespace's batch operations, and its headers."""
    content = json.dumps(document, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(content))}
    return httpx.ByteStream(content), headers


def _field(answer: Any, name: str, count: int, url: str) -> list[Any]:
    values = answer.get(name) if isinstance(answer, dict) else None
    if not isinstance(values, list) or len(values) != count:
        raise TransportError(f"{url}: malformed answer (no {count} {name!r})", url=url)
    return values


def statuses(answer: Any, count: int, url: str) -> list[KeyStatus]:
    """The ``state``/``expires_in_ms`` (and ``granted``, where a claim answered) lists of
    an answer as ``count`` :class:`KeyStatus`; a ``TransportError`` for anything else."""
    states = _field(answer, "state", count, url)
    leases = _field(answer, "expires_in_ms", count, url)
    granted = _field(answer, "granted", count, url) if "granted" in answer else [False] * count
    result = []
    for state, lease, won in zip(states, leases, granted, strict=True):
        if (
            state not in _STATES
            or type(won) is not bool
            or not (lease is None or (type(lease) is int and lease >= 0))
        ):
            raise TransportError(f"{url}: malformed claim state", url=url)
        result.append(KeyStatus(state, won, None if lease is None else lease / 1000))
    return result


def released(answer: Any, count: int, url: str) -> list[bool]:
    values = _field(answer, "released", count, url)
    if not all(type(value) is bool for value in values):
        raise TransportError(f"{url}: malformed _release answer", url=url)
    return values


def check_owner(owner: str) -> str:
    if not (1 <= len(owner) <= 128 and all("!" <= c <= "~" for c in owner)):
        raise ValueError(f"owner {owner[:40]!r}: 1-128 printable ASCII characters, no spaces")
    return owner


def unknown(hashes: Sequence[str]) -> list[KeyStatus]:
    return [UNKNOWN] * len(hashes)
