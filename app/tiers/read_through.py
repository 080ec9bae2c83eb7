"""Read-through: disk misses filled from the backend, one copy per key (single-flight).

The disk side owns read-through, as bazel-remote's disk cache does with its proxy: this
module asks the :class:`~app.tiers.base.Backend` for entries and writes them into the
disk tier through its public API (``reserve_write`` / ``PendingWrite``); the backend knows
nothing of the disk.

The first request that misses a key starts one :class:`Fill`: a background task that
streams the backend's body into a disk-tier temp file, validating it (safetensors
header, length, CRC32C against the stored ``ec-crc32c``) and committing it to the disk
tier only when everything matches. Every request for that key while the fill runs — the
one that started it and any that join — follows the fill at its own pace. It gets the
response headers as soon as the backend's answer describes the entry (its stored
metadata, which the body's safetensors header must then match), else as soon as that
header has arrived (the backend's first read is small: one round trip and a few KiB).
Then it gets each chunk **from memory** as soon as it arrived and was validated (the
fill keeps the last ``RECENT_BYTES`` received), while the store's writer threads write
it to the temp file (``OverlappedWrite``, up to ``RECENT_BYTES`` behind: readers get
the body at the backend's pace, not the disk's, and neither waits for the clients); a
reader that falls further behind reads the rest back from the temp file. So N concurrent misses make
exactly one backend read, nobody waits for the whole object before the first byte,
memory per fill is bounded, and a slow client does not slow the fill (nor the others).
Once every request that wanted the entry has left (clients gone mid-body), the fill
stops: the backend's reads in flight are closed (a large S3 object's remaining ranged
GETs, ``app/tiers/s3/ranged_get.py``) and nothing is kept; the next request starts
again.

The last chunk is only released after the fill verified the length and CRC32C of the
whole body, and the entry is committed to disk only then: a corrupt object is never
kept. A client whose object turns out corrupt has already received the response
headers (200, ``Content-Length``) and all but the last chunk; the server then closes
the connection without sending the rest, so the client sees a body shorter than its
``Content-Length`` (the SDK raises a transport error; any HTTP client reports an
incomplete read) and never a complete body with wrong bytes. The next request for the
key asks the backend again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import AsyncGenerator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, TypeVar

import anyio.to_thread
from prometheus_client import CollectorRegistry

from app.checksum import to_hex
from app.errors import (
    BackendError,
    ChecksumMismatch,
    ECError,
    InvalidBackendObject,
    InvalidBody,
    Unavailable,
)
from app.keys import EntryKey
from app.metrics import ReadThroughMetrics
from app.safetensors_format import BodyValidator, TensorHeader
from app.tiers.base import Backend, Chunk, EntryBody, EntryInfo
from app.tiers.disk import DiskTier, PendingWrite
from app.tiers.overlapped import OverlappedWrite

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Received bytes a fill keeps in memory for its readers (besides the chunk in hand).
RECENT_BYTES = 8 * 1024 * 1024


class Fill:
    """One backend -> disk copy of an entry, shared by every request that missed on it."""

    def __init__(self, owner: ReadThrough, key: EntryKey) -> None:
        self.owner = owner
        self.key = key
        loop = asyncio.get_running_loop()
        #: The entry's description once its header arrived; None when the backend has
        #: no such entry.
        self.ready: asyncio.Future[EntryInfo | None] = loop.create_future()
        #: Set once the whole body passed its length and CRC32C checks; readers release
        #: the last bytes on it, without waiting for the disk commit's fsyncs.
        self.verified: asyncio.Future[None] = loop.create_future()
        #: True once the body was verified (and committed to disk when it fits there).
        self.finished: asyncio.Future[bool] = loop.create_future()
        self.size = 0
        #: Bytes received from the backend (validated so far), and of those on disk.
        self._received = 0
        self._written = 0
        #: The chunks received last, ``(offset, chunk)``, up to ``RECENT_BYTES``: readers
        #: that keep up are sent these from memory (no read back from the temp file).
        self._recent: collections.deque[tuple[int, Chunk]] = collections.deque()
        self._recent_bytes = 0
        self._changed = asyncio.Event()
        # Read side of the temp file, shared by the readers (pread: no shared offset). It
        # outlives the rename at commit; closed when the fill is over and no reader is
        # left, or by garbage collection for a reader that was never iterated.
        self._reader_file: BinaryIO | None = None
        self._readers = 0
        self._task: asyncio.Task[None] | None = None
        #: Cancelled because every reader left (not a shutdown).
        self._abandoned = False
        # Futures nobody awaits (e.g. every client left) must not log "never retrieved".
        self.ready.add_done_callback(_consume)
        self.verified.add_done_callback(_consume)
        self.finished.add_done_callback(_consume)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"fill {self.key}")

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _abandon(self) -> None:
        """Every reader left before the end: stop reading the backend. A request that
        comes meanwhile starts a fill of its own."""
        if self._abandoned:
            return
        self._abandoned = True
        self.owner._fill_done(self)
        self.cancel()

    # -- the copy ------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def until(self, future: asyncio.Future[T]) -> T:
        """``future``'s outcome (one of this fill's), for whoever waits on the fill.
        Woken by the fill's notice, which comes with every outcome: one loop iteration
        sooner than ``asyncio.shield``, and a waiter that is cancelled leaves ``future``
        alone."""
        while not future.done():
            await self._changed.wait()
        return future.result()

    def _fail(self, exc: BaseException) -> None:
        for future in (self.ready, self.verified, self.finished):
            if not future.done():
                future.set_exception(exc)
        self._notify()

    async def _run(self) -> None:
        owner = self.owner
        tier = owner.backend.name
        what = tier.upper()
        fills = owner.metrics.fills
        pending: PendingWrite | None = None
        file: OverlappedWrite | None = None
        validator: BodyValidator | None = None
        expected: int | None = None
        # Reported only once the temp file is gone, so whoever sees the failure also
        # sees nothing left behind.
        failure: BaseException | None = None
        try:
            remote = await owner.backend.open(self.key)
            if remote is None:
                fills.labels("not_found").inc()
                self.ready.set_result(None)
                self.finished.set_result(False)
                self._notify()
                return
            async with remote:
                self.size = remote.size
                expected = remote.crc32c
                # Space is reserved here, so a copy that cannot fit fails before anything
                # is answered; the file is created in a thread once that answer is out.
                # Not durable: the backend holds the entry, a lost copy is fetched again.
                pending = owner.disk.reserve_write(self.key, remote.size, durable=False)
                validator = BodyValidator(
                    self.key.dtype,
                    max_bytes=max(remote.size, 1),
                    expected_crc=remote.crc32c,
                    declared_length=remote.size,
                )
                described = remote.header
                if described is not None and remote.crc32c is not None:
                    # Stored metadata describes the entry: answer now, one round trip
                    # sooner; the body's own header must then say the same (below).
                    self.ready.set_result(EntryInfo(remote.size, remote.crc32c, described, tier))
                    self._notify()
                async for chunk in remote.chunks():
                    validator.feed(chunk)
                    if validator.header is not None and not self.ready.done():
                        if remote.crc32c is not None:
                            self.ready.set_result(
                                EntryInfo(remote.size, remote.crc32c, validator.header, tier)
                            )
                    elif described is not None and validator.header not in (None, described):
                        raise InvalidBody(
                            f"its safetensors header says {_describe(validator.header)} "
                            f"but its metadata says {_describe(described)}"
                        )
                    # Readers get the chunk from memory at once, while it is written; the
                    # file serves those who fell behind.
                    self._remember(chunk)
                    self._notify()
                    if file is None:
                        # Readers send the first bytes before the disk's work competes
                        # with them for the CPU. The disk may then fall behind by as
                        # much as readers are served from memory: they get the body at
                        # the backend's pace, not the disk's.
                        await asyncio.sleep(0)
                        file = OverlappedWrite(
                            pending,
                            owner.writer,
                            behind=RECENT_BYTES,
                            on_written=lambda: self._on_disk(pending),
                        )
                        file.create()
                    await file.write((chunk,))
                header = validator.finish()  # length and CRC32C
                assert file is not None  # a body that passed has bytes
                self.verified.set_result(None)
                self._notify()
                await file.flush()
            created = await anyio.to_thread.run_sync(pending.commit, validator.crc, header)
            fills.labels("committed" if created else "exists").inc()
            if not self.ready.done():  # no CRC in the object's metadata: known only now
                self.ready.set_result(EntryInfo(self.size, validator.crc, header, tier))
            self.finished.set_result(True)
            self._notify()
        except asyncio.CancelledError:
            if self._abandoned:
                fills.labels("abandoned").inc()
                failure = Unavailable(f"the {what} read was stopped: every client left")
            else:
                failure = Unavailable(f"the {what} read was cancelled (server shutting down)")
            raise
        except ECError as exc:
            fills.labels("failed").inc()
            if exc.status_code < 500 and not isinstance(exc, Unavailable):
                if isinstance(exc, ChecksumMismatch) and validator is not None:
                    why = (
                        f"its body has CRC32C {to_hex(validator.crc)} but its "
                        f"ec-crc32c metadata says {to_hex(expected or 0)}"
                    )
                else:
                    why = exc.message
                log.error(
                    "%s object for %s is not a valid entry (not cached): %s", what, self.key, why
                )
                exc = InvalidBackendObject(
                    f"{what} object for {self.key} is not a valid entry: {why}"
                )
            failure = exc
        except Exception as exc:
            log.exception("%s fill of %s failed", what, self.key)
            fills.labels("failed").inc()
            failure = BackendError(f"{what} tier failed: {type(exc).__name__}: {exc}")
        finally:
            if file is not None:
                await file.settle()
            if pending is not None:
                with contextlib.suppress(OSError):
                    pending.abort()
            if failure is not None:
                self._fail(failure)
            owner._fill_done(self)
            self._maybe_close()

    def _on_disk(self, pending: PendingWrite) -> None:
        """Let readers behind the memory window read what is written by now."""
        if self._reader_file is None and pending.fd >= 0:
            self._reader_file = open(pending.path, "rb", buffering=0)  # noqa: SIM115
        if pending.written > self._written:
            self._written = pending.written
            self._notify()

    def _remember(self, chunk: Chunk) -> None:
        self._recent.append((self._received, chunk))
        self._recent_bytes += len(chunk)
        self._received += len(chunk)
        while len(self._recent) > 1 and self._recent_bytes - len(self._recent[0][1]) >= (
            RECENT_BYTES
        ):
            self._recent_bytes -= len(self._recent.popleft()[1])

    def _from_memory(self, offset: int) -> Chunk | None:
        """The received bytes from ``offset`` to the end of their chunk, if still held."""
        for start, chunk in self._recent:
            if start <= offset < start + len(chunk):
                return chunk if start == offset else chunk[offset - start :]
        return None

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
        # Once verified, the backend's part is over: the commit goes on.
        if self._readers <= 0 and not (self.verified.done() or self.finished.done()):
            self._abandon()
        self._maybe_close()

    async def stream(self, chunk_size: int) -> AsyncGenerator[Chunk, None]:
        """The body as it lands on disk. Call after ``ready`` gave an entry; ``detach``
        happens when the iterator ends or is closed."""
        try:
            size = self.size
            offset = 0
            while offset < size:
                while self._received <= offset and (failure := self._failure()) is None:
                    await self._changed.wait()
                if (failure := self._failure()) is not None:
                    raise failure
                data = self._from_memory(offset)
                if data is not None:
                    if offset + len(data) == size:
                        # Release the last bytes only once the whole body is verified.
                        await self.until(self.verified)
                    offset += len(data)
                    yield data
                    continue
                # Fell behind the memory window: read back what is on disk by now.
                while self._written <= offset and (failure := self._failure()) is None:
                    await self._changed.wait()
                if (failure := self._failure()) is not None:
                    raise failure
                end = min(self._written, offset + chunk_size)
                if end == size:
                    await self.until(self.verified)
                reader = self._reader_file
                assert reader is not None
                data = await anyio.to_thread.run_sync(
                    os.pread, reader.fileno(), end - offset, offset
                )
                if not data:
                    raise InvalidBackendObject(
                        f"{self.owner.backend.name.upper()} copy of {self.key} ended early"
                    )
                offset += len(data)
                yield data
        finally:
            self.detach()


def _describe(header: TensorHeader) -> str:
    return f"{header.dtype} [{header.shape_text}], header {header.header_length} bytes"


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class ReadThrough:
    """The backend as the store reads it: through the disk tier; see the module
    docstring."""

    def __init__(
        self,
        backend: Backend,
        disk: DiskTier,
        writer: ThreadPoolExecutor,
        registry: CollectorRegistry,
        chunk_size: int,
    ) -> None:
        self.backend = backend
        self.disk = disk
        #: The threads that write fills to disk (shared with the store's PUTs).
        self.writer = writer
        self.chunk_size = chunk_size
        self.metrics = ReadThroughMetrics(registry)
        self._fills: dict[str, Fill] = {}

    async def get(self, key: EntryKey) -> EntryBody | None:
        """The entry, streamed while it fills the disk tier; None when absent. Joins or
        starts the fill before its first await, so a caller that just missed on disk
        either sees a fill that committed meanwhile on disk or joins the one in flight."""
        fill = self.fill(key)
        try:
            # Not fill.ready itself: a client that leaves must not cancel it.
            info = await fill.until(fill.ready)
        except BaseException:
            fill.detach()
            raise
        if info is None:
            fill.detach()
            return None
        return EntryBody(info, chunks=fill.stream(self.chunk_size))

    async def head(self, key: EntryKey) -> EntryInfo | None:
        """Describe the entry from the backend, never downloading its body — except for
        an entry with no stored checksum, which is filled to disk once, like a GET."""
        info = await self.backend.head(key)
        if info is None:
            return None
        if info.crc32c is None:
            # No usable CRC32C in the metadata (object written by another tool): only a
            # full read can tell it; do that once, through the disk tier, like a GET.
            fill = self.fill(key)
            try:
                return await fill.until(fill.ready)
            finally:
                fill.detach()
        return EntryInfo(info.size, info.crc32c, info.header, self.backend.name)

    def fill(self, key: EntryKey) -> Fill:
        """The in-flight copy of ``key`` (joined) or a new one (started); attached."""
        fill = self._fills.get(key.digest)
        if fill is None:
            fill = Fill(self, key)
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
                await fill.until(fill.finished)

    def filling(self) -> list[EntryKey]:
        """The keys being copied from the backend to disk right now."""
        return [fill.key for fill in self._fills.values()]

    def _fill_done(self, fill: Fill) -> None:
        if self._fills.get(fill.key.digest) is fill:
            del self._fills[fill.key.digest]

    def stop(self) -> None:
        """Cancel the fills in flight (shutdown)."""
        for fill in list(self._fills.values()):
            fill.cancel()

    def describe(self) -> Mapping[str, object]:
        return {"fills_in_flight": len(self._fills)}
