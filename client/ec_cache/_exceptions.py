"""The one exception hierarchy of the SDK.

::

    ECCacheError
    ├── TransportError            the request did not get an HTTP answer
    │   ├── ConnectError          no replica accepted a connection
    │   └── TransportTimeout      connect/read/write timed out
    ├── ServerError               the server answered 4xx/5xx (``code`` is the JSON ``error``)
    │   └── UnavailableError      503: the server cannot tell (S3 tier unreachable)
    ├── IntegrityError            the body does not match its checksum, dtype or shape
    ├── InvalidTensorError        the tensor cannot be stored/loaded by this client
    └── InvalidKeyError           model, dtype or hash is not valid on the wire

``InvalidTensorError`` and ``InvalidKeyError`` are also ``ValueError`` s.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConnectError",
    "ECCacheError",
    "IntegrityError",
    "InvalidKeyError",
    "InvalidTensorError",
    "ServerError",
    "TransportError",
    "TransportTimeout",
    "UnavailableError",
]


class ECCacheError(Exception):
    """Base class of every error the SDK raises on purpose."""


class TransportError(ECCacheError):
    """The request got no (complete) HTTP answer: connection refused or reset, timeout,
    malformed response. ``url`` is the replica of the last attempt."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class ConnectError(TransportError):
    """No replica could be connected to (every one was tried, with retries)."""


class TransportTimeout(TransportError):
    """Connecting, sending or receiving took longer than the configured ``Timeouts``."""


class ServerError(ECCacheError):
    """The server answered with an error status.

    ``status_code`` is the HTTP status, ``code`` the stable machine code from the JSON
    error body (``"invalid_hash"``, ``"body_too_large"``, ... or ``None`` when the body
    was not ec-cache's JSON), ``part`` the part it names (``"hash"``, ``"body"``...).
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str | None = None,
        part: str | None = None,
        url: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"HTTP {status_code} {code or ''}: {message}".replace("  ", " "))
        self.status_code = status_code
        self.code = code
        self.message = message
        self.part = part
        self.url = url
        self.retry_after = retry_after

    @classmethod
    def from_response(
        cls,
        status_code: int,
        body: bytes,
        *,
        url: str | None,
        retry_after: str | None,
        error_header: str | None = None,
    ) -> ServerError:
        """Build the error from ec-cache's JSON error body (any body is accepted), or,
        for an answer without one (HEAD), from its ``X-EC-Error: code: message``."""
        import json
        from http import HTTPStatus

        code = part = None
        message = body[:500].decode("utf-8", "replace").strip()
        if not message and error_header:
            code, _, message = error_header.partition(": ")
        if not message:
            try:
                message = f"{HTTPStatus(status_code).phrase} (no error body)"
            except ValueError:
                message = "no error body"
        try:
            data: Any = json.loads(body) if body else None
        except (ValueError, RecursionError):  # not JSON, or nested too deep to parse
            data = None
        if isinstance(data, dict):
            code = data.get("error") if isinstance(data.get("error"), str) else None
            part = data.get("part") if isinstance(data.get("part"), str) else None
            if isinstance(data.get("message"), str):
                message = data["message"]
            elif isinstance(data.get("detail"), str):
                message = data["detail"]
        after: float | None = None
        if retry_after:
            try:
                after = float(retry_after)
            except ValueError:
                after = None
        kind = UnavailableError if status_code == 503 else ServerError
        return kind(status_code, message, code=code, part=part, url=url, retry_after=after)


class UnavailableError(ServerError):
    """503: the entry's state is unknown right now (e.g. the S3 tier is unreachable).

    ``get``/``head``/``exists`` treat this as a miss unless the client was created with
    ``raise_on_unavailable=True``; writes always raise it. ``retry_after`` holds the
    server's ``Retry-After`` seconds."""


class IntegrityError(ECCacheError):
    """The received body is not what the server said it is: CRC32C mismatch, dtype or
    shape different from the ``X-EC-*`` headers or from the client's dtype, or a
    malformed safetensors header. Nothing is returned to the caller."""


class InvalidTensorError(ECCacheError, ValueError):
    """The tensor cannot go through this client: wrong dtype for the client, a sparse or
    meta tensor, an ``out=`` tensor of the wrong dtype or shape."""


class InvalidKeyError(ECCacheError, ValueError):
    """A model, dtype or hash that the server would reject with 400, caught before any
    request is sent."""
