"""The S3 backend: entries in and out of one bucket, errors as the server's errors.

It implements :class:`app.tiers.base.Backend` on :class:`~app.tiers.s3.client.S3Client`
and knows nothing of the disk tier (read-through lives in ``app.tiers.read_through``):

* **names**: entry ``(model, dtype, hash)`` <-> object ``{prefix}/{model}/{dtype}/{hash}
  .safetensors``, the safetensors body byte for byte;
* **metadata**: ``ec-crc32c`` (added by ``transfers``), ``ec-dtype``, ``ec-shape`` and
  ``ec-header-length`` describe an entry, so HEAD never downloads the body; objects
  written without them cost one ranged GET of the safetensors header;
* **errors**: :class:`S3Unavailable` -> 503 ``unavailable`` with ``Retry-After``; any
  other S3 failure -> 502 ``s3_error``; an object that is not a valid entry -> 502
  ``s3_invalid_object``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import asdict
from types import TracebackType

from prometheus_client import CollectorRegistry

from app import wire
from app.errors import BackendError, ECError, InvalidBackendObject, Unavailable
from app.keys import EntryKey
from app.safetensors_format import MAX_HEADER_BYTES, PREFIX_BYTES, BodyValidator, TensorHeader
from app.settings import Settings
from app.tiers.base import Chunk, RemoteInfo
from app.tiers.s3 import conditional, readiness, transfers
from app.tiers.s3.client import S3Client
from app.tiers.s3.conditional import UNKNOWN, ConditionalWrites
from app.tiers.s3.download import S3Download
from app.tiers.s3.errors import S3Error, S3Unavailable
from app.tiers.s3.objects import ObjectInfo
from app.tiers.s3.readiness import Readiness

log = logging.getLogger(__name__)

TIER = "s3"
SUFFIX = ".safetensors"
META_SHAPE = "ec-shape"
META_HEADER_LENGTH = "ec-header-length"
META_DTYPE = "ec-dtype"


def to_http_error(exc: BaseException) -> ECError:
    """The one mapping of S3 failures to the server's errors."""
    if isinstance(exc, ECError):
        return exc
    if isinstance(exc, S3Unavailable):
        return Unavailable(
            f"S3 is unreachable, so the answer is unknown: {exc}",
            retry_after=max(1, math.ceil(exc.retry_after)),
        )
    if isinstance(exc, S3Error):
        return BackendError(str(exc))
    return BackendError(f"S3 tier failed: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def http_errors() -> Iterator[None]:
    """Re-raise S3 failures as the server's HTTP errors."""
    try:
        yield
    except S3Error as exc:
        raise to_http_error(exc) from exc


def entry_metadata(header: TensorHeader) -> dict[str, str]:
    """Object metadata describing an entry (``transfers`` adds the CRC32C)."""
    return {
        META_DTYPE: header.dtype,
        META_SHAPE: header.shape_text,
        META_HEADER_LENGTH: str(header.header_length),
    }


def header_from_metadata(key: EntryKey, info: ObjectInfo) -> TensorHeader | None:
    """The entry's header as the object's metadata describes it (None: it does not)."""
    meta = info.metadata
    try:
        shape_text = meta[META_SHAPE]
        shape = tuple(wire.decimal(dim) for dim in shape_text.split(",")) if shape_text else ()
        header = TensorHeader(key.dtype, shape, wire.decimal(meta[META_HEADER_LENGTH]))
    except (KeyError, ValueError):
        return None
    if meta.get(META_DTYPE, key.dtype) != key.dtype or header.total_length != info.size:
        return None
    return header


class S3Body:
    """An open S3 GET as a :class:`~app.tiers.base.RemoteBody` (errors mapped)."""

    def __init__(self, download: S3Download, header: TensorHeader | None) -> None:
        self._download = download
        self.size = download.info.size
        self.crc32c = download.info.crc32c
        self.header = header

    async def chunks(self) -> AsyncIterator[Chunk]:
        with http_errors():
            async for chunk in self._download.chunks():
                yield chunk

    async def aclose(self) -> None:
        await self._download.aclose()

    async def __aenter__(self) -> S3Body:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class S3Put:
    """A streaming upload as a :class:`~app.tiers.base.RemotePut` (errors mapped)."""

    def __init__(self, upload: transfers.StreamingPut) -> None:
        self._upload = upload

    async def feed(self, chunks: Sequence[bytes | memoryview]) -> None:
        await self._upload.feed(chunks)

    async def finish(self) -> bool:
        with http_errors():
            return await self._upload.finish()

    async def abort(self) -> None:
        await self._upload.abort()


class S3Backend:
    """Entries in one bucket and prefix; see the module docstring."""

    name = TIER

    def __init__(self, client: S3Client) -> None:
        self.client = client
        self.readiness_state: Readiness | None = None
        #: Which writes S3 settles itself (``If-None-Match: *``), probed once S3 is ready.
        self.conditional: ConditionalWrites | None = None

    @classmethod
    def from_settings(
        cls, settings: Settings, registry: CollectorRegistry | None = None
    ) -> S3Backend:
        return cls(S3Client(settings, registry=registry))

    def object_key(self, key: EntryKey) -> str:
        return key.object_key(self.client.prefix)

    # -- entries ---------------------------------------------------------------------

    async def head(self, key: EntryKey, *, read_header: bool = True) -> RemoteInfo | None:
        """Describe the entry from object metadata (or its header bytes), never the body."""
        object_key = self.object_key(key)
        with http_errors():
            info = await self.client.head(object_key)
            if info is None:
                return None
            header = header_from_metadata(key, info)
            if header is None:
                if not read_header:
                    return None
                header = await self._read_header(key, object_key, info.size)
        return RemoteInfo(info.size, info.crc32c, header)

    async def _read_header(self, key: EntryKey, object_key: str, size: int) -> TensorHeader:
        want = min(size, PREFIX_BYTES + MAX_HEADER_BYTES)
        head = await self.client.get_range(object_key, 0, max(want, 1))
        if head is None:
            raise InvalidBackendObject(f"S3 object for {key} vanished while being described")
        validator = BodyValidator(key.dtype, max_bytes=max(size, 1), declared_length=size)
        try:
            validator.feed(head[: min(len(head), size)])
        except ECError as exc:
            raise InvalidBackendObject(f"S3 object for {key} is not a valid entry: {exc}") from exc
        if validator.header is None:
            raise InvalidBackendObject(f"S3 object for {key} has no complete safetensors header")
        return validator.header

    async def open(self, key: EntryKey) -> S3Body | None:
        with http_errors():
            download = await self.client.open(self.object_key(key))
        if download is None:
            return None
        return S3Body(download, header_from_metadata(key, download.info))

    async def contains(self, key: EntryKey) -> bool:
        with http_errors():
            return await self.client.head(self.object_key(key)) is not None

    async def put_file(
        self, key: EntryKey, path: str | os.PathLike[str], crc32c: int, header: TensorHeader
    ) -> bool:
        """Put a local file (verified to have ``crc32c``) as the entry's object, unless
        the key has one (False). S3 settles that itself where it honours
        ``If-None-Match: *`` (``app.tiers.s3.conditional``); elsewhere, and before a
        multipart upload (not to send a large body for nothing), a ``HEAD`` asks first."""
        multipart = os.stat(path).st_size >= self.client.settings.s3_multipart_threshold
        honoured = self.conditional or UNKNOWN
        if_absent = honoured.complete_multipart if multipart else honoured.put
        if (multipart or not if_absent) and await self.contains(key):
            return False
        with http_errors():
            return await transfers.put_file(
                self.client,
                self.object_key(key),
                path,
                crc32c=crc32c,
                metadata=entry_metadata(header),
                if_absent=if_absent,
            )

    def begin_put(
        self, key: EntryKey, size: int, crc32c: int, header: TensorHeader
    ) -> S3Put | None:
        """A single ``PutObject`` streamed from the receive, below the multipart
        threshold (above it the body goes up in parts from the committed file);
        conditional where S3 honours it."""
        if size >= self.client.settings.s3_multipart_threshold:
            return None
        return S3Put(
            transfers.StreamingPut(
                self.client,
                self.object_key(key),
                size,
                crc32c,
                entry_metadata(header),
                if_absent=(self.conditional or UNKNOWN).put,
            )
        )

    async def delete(self, key: EntryKey) -> None:
        with http_errors():
            await self.client.delete(self.object_key(key))

    # -- namespaces ------------------------------------------------------------------

    def namespace_prefix(self, model: str, dtype: str) -> str:
        return EntryKey(model, dtype, "x").object_key(self.client.prefix)[: -len("x" + SUFFIX)]

    async def list_page(
        self, prefix: str, *, start_after: str | None, limit: int
    ) -> tuple[list[tuple[str, int]], str | None]:
        with http_errors():
            return await self.client.list_page(prefix, start_after=start_after, limit=limit)

    async def delete_many(self, names: Sequence[str]) -> None:
        with http_errors():
            await self.client.delete_many(names)

    # -- life cycle ------------------------------------------------------------------

    @property
    def up(self) -> bool:
        state = self.readiness_state
        return self.client.breaker.available and (state is None or state.ok)

    async def start(self) -> None:
        """Create the bucket if asked to and say, in one log line, whether S3 is usable."""
        settings = self.client.settings
        where = (
            f"{self.client.endpoint} bucket {self.client.bucket!r} prefix {settings.s3_prefix!r}"
        )
        if settings.s3_create_bucket:
            try:
                await readiness.ensure_bucket(self.client)
            except S3Error as exc:
                log.error("S3 tier: could not create bucket %r: %s", self.client.bucket, exc)
        state = await readiness.check_ready(self.client)
        self.readiness_state = state
        if state.ok:
            log.info("S3 tier ready: %s", where)
            await self._probe_conditional()
        else:
            # What other reads answer meanwhile: the mapping of ``to_http_error``.
            answer = "503 unavailable" if state.state == "unreachable" else "502 s3_error"
            log.error(
                "S3 tier NOT READY (%s): %s -- disk hits are still served; other reads "
                "answer %s until this is fixed",
                state.state,
                state.reason,
                answer,
            )

    async def stop(self) -> None:
        await self.client.close()

    async def readiness(self) -> str:
        state = await readiness.check_ready(self.client)
        self.readiness_state = state
        if state.ok and self.conditional is None:  # S3 was not ready at start-up
            await self._probe_conditional()
        return "ok" if state.ok else f"{state.state}: {state.reason}"

    async def _probe_conditional(self) -> None:
        """Learn which writes S3 settles itself (once; a failed probe is retried by the
        next readiness check, and writes ask first meanwhile)."""
        try:
            found = await conditional.probe(self.client)
        except Exception as exc:
            log.warning("S3 tier: could not probe conditional writes (retried later): %s", exc)
            return
        self.conditional = found
        if found.put and found.complete_multipart:
            log.info("S3 tier: conditional writes (If-None-Match: *) honoured")
        else:
            log.warning(
                "S3 tier: the store does not honour If-None-Match: * on %s; writers of one "
                "key on several replicas may each store a body (see docs/s3.md)",
                " and ".join(
                    name
                    for name, honoured in (
                        ("PutObject", found.put),
                        ("CompleteMultipartUpload", found.complete_multipart),
                    )
                    if not honoured
                ),
            )

    def describe(self) -> Mapping[str, object]:
        settings = self.client.settings
        state = self.readiness_state
        return {
            "endpoint": settings.s3_endpoint_url,
            "bucket": self.client.bucket,
            "prefix": settings.s3_prefix,
            "available": self.client.breaker.available,
            "ready": None if state is None else state.ok,
            "conditional_writes": None if self.conditional is None else asdict(self.conditional),
            "reason": None if state is None else state.reason,
        }
