"""The S3 tier as the store sees it: entries in, entries out, errors as ``ECError``.

Built on :class:`app.tiers.s3.ObjectStore` (the boto3 wrapper). What it adds:

* **Read-through with single-flight.** A disk miss calls :meth:`S3Tier.fill`. The first
  request for a key starts one :class:`S3Fill`: a background task that streams the
  object from S3 into a disk-tier temp file, validating it (safetensors header, length,
  CRC32C against the object's ``ec-crc32c`` metadata) and committing it to the disk tier
  only when everything matches. Every request for that key while the fill runs — the one
  that started it and any that join — *tails the temp file*: it gets the response headers
  as soon as the safetensors header has arrived and then the bytes as they land on disk,
  at its own pace. So N concurrent misses make exactly one S3 GET, nobody waits for the
  whole object before the first byte, no request holds the body in memory, and a slow or
  vanished client neither slows nor stops the fill (the disk tier is filled anyway). The
  last chunk is only released after the fill verified the CRC32C: a corrupt object aborts
  every response instead of completing it.
* **HEAD without the body**: object metadata (``ec-crc32c``, ``ec-shape``,
  ``ec-header-length``) describes the entry; objects written without it cost one ranged
  GET of the safetensors header, never the body.
* **Error mapping**: :class:`S3Unavailable` -> 503 ``unavailable`` with ``Retry-After``;
  any other S3 failure -> 502 ``s3_error``; an object that is not a valid entry ->
  502 ``s3_invalid_object``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import anyio.to_thread
from prometheus_client import CollectorRegistry, Counter

from app import wire
from app.checksum import to_hex
from app.errors import ChecksumMismatch, ECError, Unavailable
from app.keys import EntryKey
from app.safetensors_format import MAX_HEADER_BYTES, PREFIX_BYTES, BodyValidator, TensorHeader
from app.tiers.base import EntryInfo
from app.tiers.disk import DiskTier, PendingWrite
from app.tiers.s3 import ObjectInfo, ObjectStore, Readiness, S3Error, S3Unavailable

log = logging.getLogger(__name__)

TIER = "s3"
META_SHAPE = "ec-shape"
META_HEADER_LENGTH = "ec-header-length"
META_DTYPE = "ec-dtype"


class S3BackendError(ECError):
    """S3 answered, but not with what we need (credentials, permissions, bucket...)."""

    status_code = 502
    code = "s3_error"


class S3InvalidObject(S3BackendError):
    """The object in S3 is not a valid entry for its key (or failed its CRC32C)."""

    code = "s3_invalid_object"


def to_http_error(exc: BaseException) -> ECError:
    """The one mapping of S3-tier failures to the server's errors."""
    if isinstance(exc, ECError):
        return exc
    if isinstance(exc, S3Unavailable):
        return Unavailable(
            f"S3 is unreachable, so the answer is unknown: {exc}",
            retry_after=max(1, math.ceil(exc.retry_after)),
        )
    if isinstance(exc, S3Error):
        return S3BackendError(str(exc))
    return S3BackendError(f"S3 tier failed: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def http_errors() -> Iterator[None]:
    """Re-raise S3 failures as the server's HTTP errors."""
    try:
        yield
    except S3Error as exc:
        raise to_http_error(exc) from exc


def entry_metadata(header: TensorHeader) -> dict[str, str]:
    """Object metadata describing an entry (CRC32C is added by the ObjectStore)."""
    return {
        META_DTYPE: header.dtype,
        META_SHAPE: header.shape_text,
        META_HEADER_LENGTH: str(header.header_length),
    }


def _header_from_metadata(key: EntryKey, info: ObjectInfo) -> TensorHeader | None:
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


@dataclass
class S3TierMetrics:
    joins: Counter
    fills: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> S3TierMetrics:
        return cls(
            joins=Counter(
                "ec_s3_singleflight_joins",
                "Disk misses that joined an S3 read already in flight instead of starting one.",
                registry=registry,
            ),
            fills=Counter(
                "ec_s3_fills",
                "S3 -> disk copies by outcome (committed, not_found, failed, exists).",
                ["outcome"],
                registry=registry,
            ),
        )


class S3Fill:
    """One S3 -> disk copy of an entry, shared by every request that missed on it."""

    def __init__(self, tier: S3Tier, key: EntryKey) -> None:
        self.tier = tier
        self.key = key
        loop = asyncio.get_running_loop()
        #: The entry's description once its header arrived; None when S3 has no object.
        self.ready: asyncio.Future[EntryInfo | None] = loop.create_future()
        #: Set once the whole body passed its length and CRC32C checks; readers release
        #: the last bytes on it, without waiting for the disk commit's fsyncs.
        self.verified: asyncio.Future[None] = loop.create_future()
        #: True once the body was verified (and committed to disk when it fits there).
        self.finished: asyncio.Future[bool] = loop.create_future()
        self.size = 0
        self._written = 0
        self._changed = asyncio.Event()
        # Read side of the temp file, shared by the readers (pread: no shared offset). It
        # outlives the rename at commit; closed when the fill is over and no reader is
        # left, or by garbage collection for a reader that was never iterated.
        self._reader_file: BinaryIO | None = None
        self._readers = 0
        self._task: asyncio.Task[None] | None = None
        # Futures nobody awaits (e.g. every client left) must not log "never retrieved".
        self.ready.add_done_callback(_consume)
        self.verified.add_done_callback(_consume)
        self.finished.add_done_callback(_consume)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"s3-fill {self.key}")

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # -- the copy ------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _fail(self, exc: BaseException) -> None:
        for future in (self.ready, self.verified, self.finished):
            if not future.done():
                future.set_exception(exc)
        self._notify()

    async def _run(self) -> None:
        tier = self.tier
        pending: PendingWrite | None = None
        validator: BodyValidator | None = None
        expected: int | None = None
        try:
            download = await tier.objects.open(tier.object_key(self.key))
            if download is None:
                tier.metrics.fills.labels("not_found").inc()
                self.ready.set_result(None)
                self.finished.set_result(False)
                return
            async with download:
                info = download.info
                self.size = info.size
                expected = info.crc32c
                pending = await anyio.to_thread.run_sync(tier.disk.begin_write, self.key, info.size)
                self._reader_file = open(pending.path, "rb", buffering=0)  # noqa: SIM115
                validator = BodyValidator(
                    self.key.dtype,
                    max_bytes=max(info.size, 1),
                    expected_crc=info.crc32c,
                    declared_length=info.size,
                )
                async for chunk in download.chunks():
                    validator.feed(chunk)
                    await anyio.to_thread.run_sync(pending.write, [chunk])
                    self._written += len(chunk)
                    if (
                        not self.ready.done()
                        and validator.header is not None
                        and info.crc32c is not None
                    ):
                        self.ready.set_result(
                            EntryInfo(info.size, info.crc32c, validator.header, TIER)
                        )
                    self._notify()
                header = validator.finish()  # length and CRC32C
                self.verified.set_result(None)
                self._notify()
            created = await anyio.to_thread.run_sync(pending.commit, validator.crc, header)
            tier.metrics.fills.labels("committed" if created else "exists").inc()
            if not self.ready.done():  # no CRC in the object's metadata: known only now
                self.ready.set_result(EntryInfo(self.size, validator.crc, header, TIER))
            self.finished.set_result(True)
            self._notify()
        except asyncio.CancelledError:
            self._fail(Unavailable("the S3 read was cancelled (server shutting down)"))
            raise
        except S3Error as exc:
            tier.metrics.fills.labels("failed").inc()
            self._fail(to_http_error(exc))
        except ECError as exc:
            tier.metrics.fills.labels("failed").inc()
            if exc.status_code < 500 and not isinstance(exc, Unavailable):
                if isinstance(exc, ChecksumMismatch) and validator is not None:
                    why = (
                        f"its body has CRC32C {to_hex(validator.crc)} but its "
                        f"ec-crc32c metadata says {to_hex(expected or 0)}"
                    )
                else:
                    why = exc.message
                log.error("S3 object for %s is not a valid entry (not cached): %s", self.key, why)
                exc = S3InvalidObject(f"S3 object for {self.key} is not a valid entry: {why}")
            self._fail(exc)
        except Exception as exc:
            log.exception("S3 fill of %s failed", self.key)
            tier.metrics.fills.labels("failed").inc()
            self._fail(to_http_error(exc))
        finally:
            if pending is not None:
                with contextlib.suppress(OSError):
                    pending.abort()
            tier._fill_done(self)
            self._maybe_close()

    def _maybe_close(self) -> None:
        if self._readers <= 0 and self.finished.done() and self._reader_file is not None:
            self._reader_file.close()
            self._reader_file = None

    def _failure(self) -> BaseException | None:
        if self.finished.done() and not self.finished.cancelled():
            return self.finished.exception()
        return None

    # -- readers ---------------------------------------------------------------------

    def attach(self) -> None:
        """Register a reader; call synchronously when the fill is found or created."""
        self._readers += 1

    def detach(self) -> None:
        self._readers -= 1
        self._maybe_close()

    async def stream(self, chunk_size: int) -> AsyncGenerator[bytes, None]:
        """The body as it lands on disk. Call after ``ready`` gave an entry; ``detach``
        happens when the iterator ends or is closed."""
        try:
            size = self.size
            offset = 0
            while offset < size:
                while self._written <= offset and (failure := self._failure()) is None:
                    await self._changed.wait()
                if (failure := self._failure()) is not None:
                    raise failure
                end = min(self._written, offset + chunk_size)
                if end == size:
                    # Release the last bytes only once the whole body is verified.
                    await asyncio.shield(self.verified)
                reader = self._reader_file
                assert reader is not None
                data = await anyio.to_thread.run_sync(
                    os.pread, reader.fileno(), end - offset, offset
                )
                if not data:
                    raise S3InvalidObject(f"S3 copy of {self.key} ended early")
                offset += len(data)
                yield data
        finally:
            self.detach()


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class S3Tier:
    """S3 persistence for the store; see the module docstring."""

    name = TIER

    def __init__(self, objects: ObjectStore, disk: DiskTier, registry: CollectorRegistry) -> None:
        self.objects = objects
        self.disk = disk
        self.metrics = S3TierMetrics.create(registry)
        self._fills: dict[str, S3Fill] = {}
        self.readiness_state: Readiness | None = None

    def object_key(self, key: EntryKey) -> str:
        return key.object_key(self.objects.prefix)

    # -- life cycle ------------------------------------------------------------------

    async def start(self) -> Readiness:
        """Create the bucket if asked to and say, in one log line, whether S3 is usable."""
        cfg = self.objects.config
        where = f"{cfg.endpoint_url or 'AWS S3'} bucket {cfg.bucket!r} prefix {cfg.prefix!r}"
        if cfg.create_bucket:
            try:
                await self.objects.ensure_bucket()
            except S3Error as exc:
                log.error("S3 tier: could not create bucket %r: %s", cfg.bucket, exc)
        state = await self.objects.check_ready()
        self.readiness_state = state
        if state.ok:
            log.info("S3 tier ready: %s", where)
        else:
            log.error(
                "S3 tier NOT READY (%s): %s -- disk hits are still served; other reads "
                "answer 503 until this is fixed",
                state.state,
                state.reason,
            )
        return state

    async def stop(self) -> None:
        for fill in list(self._fills.values()):
            fill.cancel()
        await self.objects.close()

    async def readiness(self) -> str:
        state = await self.objects.check_ready()
        self.readiness_state = state
        return "ok" if state.ok else f"{state.state}: {state.reason}"

    # -- reads -----------------------------------------------------------------------

    def fill(self, key: EntryKey) -> S3Fill:
        """The in-flight copy of ``key`` (joined) or a new one (started); attached."""
        fill = self._fills.get(key.digest)
        if fill is None:
            fill = S3Fill(self, key)
            self._fills[key.digest] = fill
            fill.start()
        else:
            self.metrics.joins.inc()
        fill.attach()
        return fill

    async def settle(self, key: EntryKey) -> None:
        """Wait until no copy of ``key`` is in flight (its outcome does not matter), so
        that a DELETE is not undone by a fill that commits after it."""
        fill = self._fills.get(key.digest)
        if fill is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(fill.finished)

    def filling(self) -> list[EntryKey]:
        """The keys being copied from S3 to disk right now."""
        return [fill.key for fill in self._fills.values()]

    def _fill_done(self, fill: S3Fill) -> None:
        if self._fills.get(fill.key.digest) is fill:
            del self._fills[fill.key.digest]

    async def head(self, key: EntryKey) -> EntryInfo | None:
        """Describe the entry from object metadata (or its header bytes), never the body."""
        object_key = self.object_key(key)
        with http_errors():
            info = await self.objects.head(object_key)
            if info is None:
                return None
            header = _header_from_metadata(key, info)
            crc = info.crc32c
            if header is None:
                header = await self._read_header(key, object_key, info.size)
        if header is None:
            return None
        if crc is None:
            # No usable CRC32C in the metadata (object written by another tool): only a
            # full read can tell it; do that once, through the disk tier, like a GET.
            fill = self.fill(key)
            fill.detach()
            return await asyncio.shield(fill.ready)
        return EntryInfo(info.size, crc, header, TIER)

    async def _read_header(self, key: EntryKey, object_key: str, size: int) -> TensorHeader:
        want = min(size, PREFIX_BYTES + MAX_HEADER_BYTES)
        head = await self.objects.get_range(object_key, 0, max(want, 1))
        if head is None:
            raise S3InvalidObject(f"S3 object for {key} vanished while being described")
        validator = BodyValidator(key.dtype, max_bytes=max(size, 1), declared_length=size)
        try:
            validator.feed(head[: min(len(head), size)])
        except ECError as exc:
            raise S3InvalidObject(f"S3 object for {key} is not a valid entry: {exc}") from exc
        if validator.header is None:
            raise S3InvalidObject(f"S3 object for {key} has no complete safetensors header")
        return validator.header

    async def exists(self, key: EntryKey) -> bool:
        with http_errors():
            return await self.objects.head(self.object_key(key)) is not None

    # -- writes ----------------------------------------------------------------------

    async def upload(
        self,
        key: EntryKey,
        path: str | os.PathLike[str],
        crc32c: int,
        header: TensorHeader,
    ) -> None:
        """Put a local file (verified to have ``crc32c``) as the entry's object."""
        with http_errors():
            await self.objects.put_file(
                self.object_key(key), path, crc32c=crc32c, metadata=entry_metadata(header)
            )

    async def delete(self, key: EntryKey) -> None:
        with http_errors():
            await self.objects.delete(self.object_key(key))

    def describe(self) -> Mapping[str, object]:
        cfg = self.objects.config
        state = self.readiness_state
        return {
            "endpoint": cfg.endpoint_url,
            "bucket": cfg.bucket,
            "prefix": cfg.prefix,
            "available": self.objects.available,
            "ready": None if state is None else state.ok,
            "reason": None if state is None else state.reason,
            "fills_in_flight": len(self._fills),
        }
