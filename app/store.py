"""The store: answers entry requests by asking the tiers in order, and namespace
requests (usage, listing, purges: ``app.namespaces``).

Routes talk only to this class (``tests/unit/test_structure.py`` checks). It validates
bodies as they stream in, decides which tier answers, and keeps slow file work off the
event loop. Like bazel-remote's disk cache in front of its proxy, the store owns
read-through (``app.tiers.read_through``) and calls the backend
(``app.tiers.base.Backend``, the S3 backend when configured) for the rest; what a
validated body becomes, and the remote side of a DELETE, is the write policy's
(``app.write_policy``), chosen once by ``create_app``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import anyio.to_thread

from app.errors import ECError, InvalidRequest, NotFound, Unavailable
from app.keys import EntryKey
from app.metrics import Metrics
from app.namespaces import PurgeJob, Purges, disk_page, s3_page
from app.safetensors_format import BodyValidator
from app.settings import Settings
from app.tiers.base import EntryBody, EntryInfo, RemoteTier
from app.tiers.disk import DiskStats, DiskTier, NamespaceUsage
from app.tiers.overlapped import OverlappedWrite
from app.tiers.read_through import ReadThrough
from app.write_policy import WritePolicy

#: Received chunks are batched into writes of about this size, each in a writer thread
#: while the next batch is received (a write can stall behind a file-system journal
#: commit, so never on the event loop).
WRITE_BATCH_BYTES = 1024 * 1024
#: Threads that create temp files and write bodies into them (one job in flight per
#: PUT; more PUTs than threads queue their jobs).
WRITER_THREADS = 16


@dataclass(frozen=True)
class PutResult:
    created: bool
    size: int
    crc32c: int


#: Concurrent S3 HEADs of one batch existence check.
EXISTS_CONCURRENCY = 16


class Store:
    def __init__(
        self,
        settings: Settings,
        disk: DiskTier,
        metrics: Metrics,
        s3: RemoteTier | None,
        writes: WritePolicy,
    ) -> None:
        self.settings = settings
        self.disk = disk
        self.metrics = metrics
        self._writer = ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="ec-disk-write")
        #: The backend (S3), and the read-through that fills the disk tier from it.
        self.s3 = s3
        self.read_through = (
            ReadThrough(s3, disk, self._writer, metrics.registry, settings.s3_get_chunk_size)
            if s3 is not None
            else None
        )
        self.writes = writes
        self.purges = Purges(settings.data_dir, disk, s3, self.read_through, writes)
        if s3 is not None:
            metrics.watch_s3(lambda: s3.up)

    async def start(self) -> None:
        # Running purges guard their namespaces before any request is answered.
        await anyio.to_thread.run_sync(self.purges.load)
        await anyio.to_thread.run_sync(self.writes.load)
        await anyio.to_thread.run_sync(self.disk.rebuild)
        await self.writes.start()
        if self.s3 is not None:
            await self.s3.start()
        await self.purges.start()

    async def stop(self) -> None:
        """Stop background work; pending write-back uploads stay in the journal."""
        await self.purges.stop()
        await self.writes.stop(self.settings.writeback_drain_timeout)
        if self.read_through is not None:
            self.read_through.stop()
        if self.s3 is not None:
            await self.s3.stop()
        await anyio.to_thread.run_sync(self.disk.close)
        await anyio.to_thread.run_sync(self._writer.shutdown)

    # -- reads --------------------------------------------------------------------

    async def _open_disk(self, key: EntryKey) -> EntryBody | None:
        opened = self.disk.open(key)
        if opened is not None and not opened.verified:
            opened = await anyio.to_thread.run_sync(self.disk.verify, opened)
        return opened.body() if opened is not None else None

    async def get(self, key: EntryKey) -> EntryBody:
        if self.purges.blocks(key):  # being purged: gone already
            self.metrics.lookup(key.model, key.dtype, "miss")
            raise NotFound(f"no entry {key} (its namespace is being purged)")
        body = await self._open_disk(key)
        if body is None and self.read_through is not None and not self._s3_hidden(key):
            # No await between the disk miss and joining/starting the fill: a fill
            # that just committed is seen on disk, one in flight is joined.
            body = await self.read_through.get(key)
        if body is None:
            self.metrics.lookup(key.model, key.dtype, "miss")
            raise NotFound(f"no entry {key}")
        self.metrics.lookup(key.model, key.dtype, body.info.tier)
        return body

    async def head(self, key: EntryKey) -> EntryInfo:
        info = None if self.purges.blocks(key) else self.disk.info(key)
        if info is None and not self.purges.blocks(key):
            body = await self._open_disk(key)
            info = body.info if body is not None else None
        if (
            info is None
            and self.read_through is not None
            and not self.purges.blocks(key)
            and not self._s3_hidden(key)
        ):
            info = await self.read_through.head(key)  # object metadata: never the body
        if info is None:
            self.metrics.lookup(key.model, key.dtype, "miss")
            raise NotFound(f"no entry {key}")
        self.metrics.lookup(key.model, key.dtype, info.tier)
        return info

    async def exists(self, key: EntryKey) -> bool:
        """Whether a PUT of ``key`` would store nothing (``If-None-Match: *``). While S3
        is unreachable write-back answers from its disk and journal (absent unless here):
        the upload settles a race with another replica later, as any upload does."""
        if self.purges.blocks(key):
            return False
        if self.disk.contains(key):
            return True
        if self.s3 is None or self._s3_hidden(key):
            return False
        try:
            return await self.s3.contains(key)
        except Unavailable:
            if not self.writes.decides_without_s3:
                raise
            return False

    def _s3_hidden(self, key: EntryKey) -> bool:
        """Whether the key's S3 object must not be read: a DELETE of it is not over."""
        return self.writes.hiding and self.writes.hides(key)

    async def exists_many(self, model: str, dtype: str, hashes: Sequence[str]) -> list[bool]:
        """Presence of many validated hashes of one model and dtype, in order. Keys are
        built only for the disk misses that S3 is asked about (1000 at a time here)."""
        if hashes and self.purges.blocks(EntryKey(model, dtype, hashes[0])):
            return [False] * len(hashes)
        present = self.disk.contains_hashes(model, dtype, hashes)
        s3 = self.s3
        if s3 is None or all(present):
            return present
        limit = asyncio.Semaphore(EXISTS_CONCURRENCY)

        async def check(key: EntryKey) -> bool:
            async with limit:
                return await s3.contains(key)

        missing = [index for index, found in enumerate(present) if not found]
        if self.writes.hiding:
            missing = [i for i in missing if not self._s3_hidden(EntryKey(model, dtype, hashes[i]))]
        answers = await asyncio.gather(
            *(check(EntryKey(model, dtype, hashes[index])) for index in missing)
        )
        for index, found in zip(missing, answers, strict=True):
            present[index] = found
        return present

    # -- writes -------------------------------------------------------------------

    async def put(
        self,
        key: EntryKey,
        body: AsyncIterator[bytes],
        *,
        declared_length: int | None,
        expected_crc: int | None,
        known_absent: bool = False,
    ) -> PutResult:
        """Stream ``body`` into a temp file, validating as it goes, then commit it.

        Raises before the body is fully read when it is known to be bad; nothing is
        left behind on any error, including the client going away. ``known_absent``:
        the caller has just found the entry in no tier (``If-None-Match: *``).
        """
        self._refuse_if_purging(key)
        stream = self.writes.stream(key, declared_length, expected_crc, known_absent)
        validator = BodyValidator(
            key.dtype,
            max_bytes=self.settings.max_body_bytes,
            expected_crc=expected_crc,
            declared_length=declared_length,
        )
        # Refused here, before any body byte is read, when it cannot fit; the temp file
        # is created in a writer thread while the first batch comes in.
        pending = self.disk.reserve_write(key, declared_length, durable=self.writes.durable)
        body_file = OverlappedWrite(pending, self._writer)
        try:
            body_file.create()
            batch: list[bytes] = []
            batched = 0
            async for chunk in body:
                validator.feed(chunk)
                if stream is not None:
                    await stream.feed((chunk,), validator.header)
                if pending.expected is None and validator.header is not None:
                    # No Content-Length: the header gives the length; refuse now if
                    # it cannot fit rather than evict for it.
                    await anyio.to_thread.run_sync(pending.expect, validator.header.total_length)
                batch.append(chunk)
                batched += len(chunk)
                if batched >= WRITE_BATCH_BYTES:
                    await body_file.write(batch)
                    batch, batched = [], 0
            if batch:
                await body_file.write(batch)
            await body_file.flush()
            header = validator.finish()
            self._refuse_if_purging(key)  # a purge may have started while the body came in
            created = await self.writes.commit(key, pending, validator.crc, header, stream)
        finally:
            # Also runs on cancellation (client gone): remove the temp file at once,
            # withdraw the upload.
            await body_file.settle()
            with contextlib.suppress(OSError):
                pending.abort()
            if stream is not None:
                await asyncio.shield(stream.abort())
        if created:
            self.metrics.bytes_received.inc(validator.received)
            return PutResult(True, validator.received, validator.crc)
        # Lost the first-writer race: answer with what is stored, not with this body.
        stored = await self._stored_info(key)
        if stored is None:  # removed again since (DELETE, eviction): nothing better to say
            return PutResult(False, validator.received, validator.crc)
        return PutResult(False, stored.size, stored.crc32c)

    async def _stored_info(self, key: EntryKey) -> EntryInfo | None:
        """The stored entry's description, for a PUT that stored nothing."""
        info = self.disk.info(key)
        if info is None:
            body = await self._open_disk(key)
            if body is not None:  # known after a restart only once verified, as by a GET
                info = body.info
                if body.buffer is not None:
                    body.buffer.release()
        if info is None and self.read_through is not None:
            with contextlib.suppress(ECError):  # S3 gone since: no better answer
                info = await self.read_through.head(key)
        return info

    def _refuse_if_purging(self, key: EntryKey) -> None:
        if self.purges.blocks(key):
            raise Unavailable(
                f"namespace {key.model}/{key.dtype} is being purged: retry later", retry_after=5
            )

    async def delete(self, key: EntryKey) -> None:
        """Remove from every tier: the disk copy here, once the fills of the key in
        flight are over; the S3 object as the write policy says (at once, or owed)."""
        async with self.writes.deleting(key):
            if self.read_through is not None:
                await self.read_through.settle(key)
            await anyio.to_thread.run_sync(self.disk.delete, key)

    # -- namespaces -----------------------------------------------------------------

    def namespace_usage(self) -> tuple[list[NamespaceUsage], NamespaceUsage]:
        """Usage per namespace on this replica's disk (sorted), and that of the
        unattributed entries."""
        return self.disk.namespaces()

    def disk_stats(self) -> DiskStats:
        return self.disk.stats()

    async def list_namespace(
        self, model: str, dtype: str, tier: str, after: str | None, limit: int
    ) -> tuple[list[dict[str, Any]], str | None]:
        """A page of a namespace's entries in ``tier`` (``disk`` or ``s3``) with hashes
        after ``after``, and the cursor of the next page (None at the end)."""
        if tier == "s3":
            if self.s3 is None:
                raise InvalidRequest("this server has no S3 tier", part="tier")
            return await s3_page(self.s3, model, dtype, after, limit)
        return await disk_page(self.disk, model, dtype, after, limit)

    async def purge(self, model: str, dtype: str | None) -> tuple[PurgeJob, bool]:
        """Start a purge of the namespace(s), or find the one running; True when this
        call started it (see ``app.namespaces``)."""
        return await self.purges.request(model, dtype)

    def purge_jobs(self) -> list[PurgeJob]:
        """Purges running and recently finished, newest first."""
        return self.purges.listing()

    # -- operations ---------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """A JSON summary for operators (``GET /stats``, ``ec-cache stats``)."""
        lookups = {
            result: int(
                self.metrics.registry.get_sample_value("ec_cache_lookups_total", {"result": result})
                or 0
            )
            for result in ("disk", "s3", "miss")
        }
        result: dict[str, Any] = {
            "disk": asdict(self.disk.stats()),
            "lookups": lookups,
            "write_mode": self.settings.write_mode.value,
            "s3_configured": self.settings.s3_enabled,
        }
        if self.s3 is not None and self.read_through is not None:
            result["s3"] = {**self.s3.describe(), **self.read_through.describe()}
        queue = self.writes.describe()
        if queue is not None:
            result["upload_queue"] = queue
        return result

    async def readiness(self) -> dict[str, str]:
        """Check name -> "ok" or the reason it failed."""
        checks = {"disk": await anyio.to_thread.run_sync(_check_writable, self.disk)}
        if self.s3 is not None:
            checks["s3"] = await self.s3.readiness()
        self.metrics.readiness(all(result == "ok" for result in checks.values()))
        return checks


def _check_writable(disk: DiskTier) -> str:
    try:
        pending = disk.begin_write(EntryKey("_readyz", "uint8", "probe"))
        pending.abort()
    except OSError as exc:
        return f"disk tier at {disk.root} is not writable: {exc.strerror}"
    return "ok"
