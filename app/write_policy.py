"""The write path: one policy per write mode, chosen once by ``create_app``.

The store receives and validates a PUT's body into a disk-tier temp file; what happens
then is the policy's, and so is the remote side of a DELETE:

* :class:`DiskOnlyPolicy` (no S3): the disk decides; the first commit of a key wins.
* :class:`WriteThroughPolicy`: 201 only once S3 holds the entry. The upload overlaps
  the receive when it can (``app.tiers.write_through``); S3's conditional write
  settles writers racing on several replicas (``put_file`` / ``finish`` answer False
  to a loser, which commits nothing). The disk copy follows S3's, so it is not synced.
* :class:`WriteBackPolicy`: 201 once the entry and its journal record are durable on
  disk (``app.tiers.upload_journal``); the upload runs later from the scheduler
  (``app.tiers.upload_scheduler``), which this policy hands its upload and delete. An
  upload that loses in S3 (another replica, or a body written before this disk
  evicted the key, came first) drops this replica's copy: its next read fills S3's,
  so every replica converges on the first body. Falls back to write-through for a PUT
  when the queue is full.

Every policy answers a PUT of a key already on this disk from the disk (first writer
wins). A DELETE's local part (settling fills, removing the disk copy) is the store's,
run inside :meth:`WritePolicy.deleting`, which hides the key's S3 object from reads
until S3 confirmed the delete (write-through) or the delete is owed, journaled
(write-back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio.to_thread
from prometheus_client import CollectorRegistry

from app.checksum import to_hex
from app.keys import EntryKey
from app.safetensors_format import TensorHeader
from app.settings import Settings
from app.tiers.base import Backend
from app.tiers.disk import DiskTier, PendingWrite, StagedFile
from app.tiers.upload_journal import PendingUpload, UploadJournal
from app.tiers.upload_scheduler import EntryGone, UploadScheduler
from app.tiers.write_through import WriteThrough

log = logging.getLogger(__name__)


class WritePolicy(Protocol):
    """What the store asks of the write mode; see the module docstring."""

    #: Whether a new entry's disk copy must be durable before its PUT is answered.
    durable: bool
    #: Whether, while S3 cannot say if it holds a key, a conditional PUT is decided
    #: from this disk (and journal) rather than refused with 503.
    decides_without_s3: bool

    def stream(
        self, key: EntryKey, size: int | None, crc32c: int | None, known_absent: bool
    ) -> WriteThrough | None:
        """The upload to run while the body is received (None: none, or not now)."""
        ...

    async def commit(
        self,
        key: EntryKey,
        pending: PendingWrite,
        crc: int,
        header: TensorHeader,
        stream: WriteThrough | None,
    ) -> bool:
        """Store a received, validated body; False when the key's entry is another's."""
        ...

    def deleting(self, key: EntryKey) -> contextlib.AbstractAsyncContextManager[None]:
        """Around the store's local part of a DELETE: hides the key's S3 object and
        deletes it (or owes its delete) once the local part is done."""
        ...

    def hides(self, key: EntryKey) -> bool:
        """Whether the key's S3 object must not be read (a DELETE of it is not over)."""
        ...

    @property
    def hiding(self) -> bool:
        """Whether any key is hidden now (to skip the per-key checks)."""
        ...

    async def before_purge(self, covers: Callable[[str, str], bool]) -> None:
        """A purge of the namespaces ``covers`` accepts starts its work."""
        ...

    def load(self) -> None:
        """Start-up, before the disk index is rebuilt (blocking)."""
        ...

    async def start(self) -> None:
        """Start-up, once the disk index is rebuilt."""
        ...

    async def stop(self, drain_timeout: float) -> None: ...

    def describe(self) -> dict[str, Any] | None:
        """The ``upload_queue`` section of ``/stats`` (None: there is none)."""
        ...


async def commit_durably(
    pending: PendingWrite, crc: int, header: TensorHeader, staged: Sequence[StagedFile] = ()
) -> bool:
    """Commit ``pending`` as a durable entry (with its ``staged`` journal records).
    Shielded: a PUT whose client goes away meanwhile still waits for the batch, so what
    it reserved is released only once the outcome is known."""
    pending.durable = True
    commit: Future[bool] = pending.submit(crc, header, staged)
    with anyio.CancelScope(shield=True):
        created = await asyncio.wrap_future(commit)
    return created


class _Defaults:
    """What a policy does where it has nothing to do: no upload beside the receive,
    nothing hidden, nothing to load, drain or report."""

    decides_without_s3 = False

    def stream(
        self, key: EntryKey, size: int | None, crc32c: int | None, known_absent: bool
    ) -> WriteThrough | None:
        return None

    def hides(self, key: EntryKey) -> bool:
        return False

    @property
    def hiding(self) -> bool:
        return False

    async def before_purge(self, covers: Callable[[str, str], bool]) -> None:
        return None

    def load(self) -> None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self, drain_timeout: float) -> None:
        return None

    def describe(self) -> dict[str, Any] | None:
        return None


class DiskOnlyPolicy(_Defaults):
    """No S3: the disk decides."""

    durable = True

    async def commit(
        self,
        key: EntryKey,
        pending: PendingWrite,
        crc: int,
        header: TensorHeader,
        stream: WriteThrough | None,
    ) -> bool:
        return await commit_durably(pending, crc, header)

    @contextlib.asynccontextmanager
    async def deleting(self, key: EntryKey) -> AsyncIterator[None]:
        yield


@dataclass(eq=False)
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class _KeyLocks:
    """One lock per key while someone holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, _KeyLock] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: EntryKey) -> AsyncIterator[None]:
        held = self._locks.setdefault(key.digest, _KeyLock())
        held.users += 1
        try:
            async with held.lock:
                yield
        finally:
            held.users -= 1
            if not held.users:
                del self._locks[key.digest]


class WriteThroughPolicy(_Defaults):
    """201 only once S3 holds the entry; on any S3 failure nothing is stored."""

    durable = False  # S3 holds what the disk copies

    def __init__(self, disk: DiskTier, s3: Backend) -> None:
        self.disk = disk
        self.s3 = s3
        #: Keys whose DELETE is in progress, by digest (how many).
        self._deleting: Counter[str] = Counter()
        #: A PUT's upload and disk commit, and a DELETE, of one key never interleave:
        #: else a DELETE between the two would leave the entry on disk and not in S3.
        self._keys = _KeyLocks()

    def stream(
        self, key: EntryKey, size: int | None, crc32c: int | None, known_absent: bool
    ) -> WriteThrough | None:
        """Overlapped when the length and CRC32C are known up front and the entry is
        not on this disk already."""
        if size is None or crc32c is None or self.disk.contains(key):
            return None
        return WriteThrough(self.s3, key, size, crc32c, known_absent=known_absent)

    async def commit(
        self,
        key: EntryKey,
        pending: PendingWrite,
        crc: int,
        header: TensorHeader,
        stream: WriteThrough | None,
    ) -> bool:
        if self.disk.contains(key):
            return False  # here already, so in S3: that is the entry
        async with self._keys.hold(key):
            if stream is not None and await stream.present():
                return False  # another replica wrote it first: theirs is the entry
            if stream is not None and stream.upload is not None:
                stored = await stream.finish()
            else:  # not streamed (length or CRC32C unknown, or too large): the file
                stored = await self.s3.put_file(key, pending.path, crc, header)
            if not stored:  # lost the race in S3: theirs is the entry, never on this disk
                return False
            return await anyio.to_thread.run_sync(pending.commit, crc, header)

    @contextlib.asynccontextmanager
    async def deleting(self, key: EntryKey) -> AsyncIterator[None]:
        """Hidden until S3 confirmed (or refused: then the DELETE fails, and S3's
        object is the entry again), so a read in between cannot copy it back to disk."""
        self._deleting[key.digest] += 1
        try:
            async with self._keys.hold(key):
                yield
                await self.s3.delete(key)
        finally:
            self._deleting[key.digest] -= 1
            if not self._deleting[key.digest]:
                del self._deleting[key.digest]

    def hides(self, key: EntryKey) -> bool:
        return bool(self._deleting) and key.digest in self._deleting

    @property
    def hiding(self) -> bool:
        return bool(self._deleting)


class WriteBackPolicy(_Defaults):
    """201 once durable on disk; uploads and deletes later, from the scheduler."""

    durable = True
    decides_without_s3 = True  # the upload settles a race later, as any upload does

    def __init__(
        self, settings: Settings, disk: DiskTier, s3: Backend, registry: CollectorRegistry
    ) -> None:
        self.disk = disk
        self.s3 = s3
        self.scheduler = UploadScheduler(
            UploadJournal(settings.data_dir),
            disk,
            self.upload,
            s3.delete,
            max_entries=settings.writeback_queue_max_entries,
            max_bytes=settings.writeback_max_bytes,
            workers=settings.writeback_workers,
            retry_min=settings.writeback_retry_min,
            retry_max=settings.writeback_retry_max,
            registry=registry,
        )
        #: For a PUT that finds the queue full (never dropped).
        self._through = WriteThroughPolicy(disk, s3)

    async def commit(
        self,
        key: EntryKey,
        pending: PendingWrite,
        crc: int,
        header: TensorHeader,
        stream: WriteThrough | None,
    ) -> bool:
        scheduler = self.scheduler
        # The disk decides, and a body that becomes the entry is journaled with it: also
        # a PUT of a key on disk already, whose entry may go before the commit (a lost
        # upload dropping it). A key on disk or in the queue (a PUT committing, a delete
        # owed, which must go first) shares its record, over the bounds if need be.
        if (
            self.disk.contains(key)
            or scheduler.contains(key)
            or scheduler.has_room(pending.written)
        ):
            return await self._journal_and_commit(key, pending, crc, header)
        scheduler.metrics.full.inc()
        return await self._through.commit(key, pending, crc, header, None)

    async def _journal_and_commit(
        self, key: EntryKey, pending: PendingWrite, crc: int, header: TensorHeader
    ) -> bool:
        """Journal the upload, then commit to disk (pinned until uploaded)."""
        item = self.scheduler.reserve(key, pending.written, crc)
        created = False
        try:
            # Every PUT stages the (identical) record itself: whichever commits first,
            # its record is durable before its entry is visible (same group commit).
            # Creating a file can wait for a journal commit, so a thread does it; the
            # record staged is handed to the commit even if the PUT goes away.
            with anyio.CancelScope(shield=True):
                record = await anyio.to_thread.run_sync(self.scheduler.stage_record, item)
            created = await commit_durably(pending, crc, header, (record,))
        finally:
            self.scheduler.release(item, created=created)
        return created

    async def upload(self, item: PendingUpload) -> bool:
        """The scheduler's upload: disk entry (verified) -> S3. False when S3 held
        another body of the key (a writer on another replica, or before this disk's
        copy was evicted, came first): that body is the entry, so this replica drops
        its copy and its next read fills S3's (it converges on the winner)."""
        opened = self.disk.open(item.key)
        if opened is None:
            raise EntryGone("not on disk any more")
        view = opened.view
        try:
            if not opened.verified:
                checked = await anyio.to_thread.run_sync(self.disk.verify, opened)
                if checked is None:
                    raise EntryGone("its bytes on disk are corrupt (entry dropped)")
            entry = opened.entry
            path, crc, header = entry.path, entry.crc32c, entry.header
        finally:
            view.close()
        assert header is not None
        if await self.s3.put_file(item.key, path, crc, header):
            return True
        winner = await self.s3.head(item.key, read_header=False)
        if winner is not None and winner.crc32c == crc:
            return True  # the same bytes (another writer's, or an earlier attempt of ours)
        log.warning(
            "write-back: S3 holds another body of %s (crc32c %s, this replica's %s): "
            "dropping this replica's copy for it",
            item.key,
            "unknown" if winner is None or winner.crc32c is None else to_hex(winner.crc32c),
            to_hex(crc),
        )
        await anyio.to_thread.run_sync(self.disk.delete, item.key)
        return False

    @contextlib.asynccontextmanager
    async def deleting(self, key: EntryKey) -> AsyncIterator[None]:
        """The S3 delete is owed through the scheduler: journaled before the disk copy
        goes (from then on the S3 object is hidden from reads), sent at once unless an
        upload of the key is in flight (then right after it), retried until S3
        confirms."""
        item = await self.scheduler.mark_deleted(key)
        yield
        await self.scheduler.delete_now(item)

    def hides(self, key: EntryKey) -> bool:
        return self.scheduler.hides(key)

    @property
    def hiding(self) -> bool:
        return bool(self.scheduler.deletes_pending)

    async def before_purge(self, covers: Callable[[str, str], bool]) -> None:
        await self.scheduler.delete_namespace(covers)

    def load(self) -> None:
        self.scheduler.load()  # pins pending uploads before anything is evicted

    async def start(self) -> None:
        await anyio.to_thread.run_sync(self.scheduler.reconcile)
        await self.scheduler.start()

    async def stop(self, drain_timeout: float) -> None:
        """Pending uploads stay in the journal."""
        await self.scheduler.stop(drain_timeout)

    def describe(self) -> dict[str, Any] | None:
        scheduler = self.scheduler
        return {
            "entries": len(scheduler),
            "deletes": scheduler.deletes_pending,
            "bytes": scheduler.pending_bytes,
            "max_entries": scheduler.max_entries,
            "max_bytes": scheduler.max_bytes,
        }
