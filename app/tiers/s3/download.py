"""An open S3 GET: the object's description known, its body still on the wire.

The body comes from the data plane's GET (``data_plane``) and is read in chunks, never
buffered whole. A connection that breaks mid-body, or a body shorter than announced, is
an :class:`S3Unavailable` (and opens the breaker): the body is then incomplete and must
not be used.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from app.metrics import S3Metrics
from app.tiers.base import Chunk
from app.tiers.s3.breaker import CircuitBreaker
from app.tiers.s3.errors import S3Unavailable, map_error
from app.tiers.s3.objects import ObjectInfo

#: The first chunk of a GET body: small, so the safetensors header (and with it a
#: read-through's answer) is known after one round trip. Chunks then grow x8 up to
#: ``EC_S3_GET_CHUNK_SIZE``.
FIRST_READ_BYTES = 64 * 1024
#: Chunks a download reads ahead of its consumer at most.
READ_AHEAD = 2
#: The answers whose body is the object's: whole (200) or the span asked for (206).
OK = (200, 206)


class ObjectBody(Protocol):
    """The body of an open GET, from any of the data plane's HTTP layers (``loop_get``,
    ``signed_http``, ``data_plane.Boto3Http``)."""

    async def read(self) -> Chunk:
        """The next chunk; ``b""`` at the end. Raises the transport's exceptions."""
        ...

    async def aclose(self) -> None: ...


class S3Download:
    """An open S3 GET: ``info`` is known, the body is read with :meth:`chunks`. Always
    ``aclose()`` it; closing early drops the connection instead of draining the body."""

    def __init__(
        self, info: ObjectInfo, body: ObjectBody, breaker: CircuitBreaker, metrics: S3Metrics
    ) -> None:
        self.info = info
        self._body = body
        self._breaker = breaker
        self._metrics = metrics
        self._started = self._closed = False

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Yield the body in chunks of up to ``EC_S3_GET_CHUNK_SIZE`` bytes. Raises
        :class:`S3Unavailable` when the connection breaks mid-body (the body is then
        incomplete and must not be used)."""
        if self._closed or self._started:
            raise RuntimeError("download already closed or being read")
        self._started = True
        metrics = self._metrics
        received = 0
        try:
            while True:
                try:
                    chunk = await self._body.read()
                except Exception as exc:
                    raise map_error(exc, "get", self._breaker.cooldown) from exc
                if not chunk:
                    break
                received += len(chunk)
                metrics.bytes_down.inc(len(chunk))
                yield chunk
        except S3Unavailable:
            self._breaker.mark_unavailable()
            metrics.requests.labels("get_body", "unavailable").inc()
            raise
        if received != self.info.size:
            # The connection closed early (a reset or an outage seen as a short body).
            self._breaker.mark_unavailable()
            metrics.requests.labels("get_body", "unavailable").inc()
            raise S3Unavailable(
                f"S3 get of {self.info.key}: body ended after {received} of {self.info.size} bytes"
            )
        metrics.requests.labels("get_body", "ok").inc()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._body.aclose()
