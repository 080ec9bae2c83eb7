"""The write-back upload queue: durable, bounded, retried with exponential backoff.

In ``write-back`` mode a PUT answers 201 once the entry is committed to the disk tier; its
upload to S3 happens later, from this queue. Durability comes from a journal directory::

    {data_dir}/upload-queue/{key digest}.json     one small record per pending entry

A record is written atomically (temp file, ``fdatasync``, ``rename``, ``fsync`` of the
directory) *before* the entry is published on disk — in the disk tier's group commit of
that entry, see :meth:`UploadQueue.stage_record` — and removed only after S3 has the
object, so neither a restart nor ``kill -9`` loses an upload: the directory is rescanned
at start-up. A record whose disk entry is missing (the PUT never completed, or the entry
was deleted) is dropped. Every pending entry is pinned in the disk tier, so it is never
evicted before it is uploaded.

The queue is bounded by entries and bytes. When it is full the store does not drop
anything: it falls back to write-through for that PUT (which answers 503 if S3 is down).
Failed uploads are retried with exponential backoff and jitter; one success resets the
backoff of all waiting entries, so the queue drains quickly once S3 is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from app.errors import InvalidKey
from app.keys import EntryKey
from app.metrics import UploadQueueMetrics
from app.tiers.disk import DiskTier, StagedFile, fsync_dir

log = logging.getLogger(__name__)

JOURNAL_DIR = "upload-queue"
#: Seconds between upload-failure log lines while uploads keep failing.
LOG_INTERVAL = 30.0


class EntryGone(Exception):
    """The local entry to upload no longer exists (deleted, or corrupt and dropped)."""


@dataclass
class PendingUpload:
    key: EntryKey
    size: int
    crc32c: int
    queued_at: float  # wall clock, for operators
    attempts: int = 0
    next_attempt: float = 0.0  # monotonic
    last_error: str | None = None
    in_progress: bool = False
    #: Set by a DELETE while an upload runs: the object is deleted again afterwards.
    deleted: bool = False
    #: PUTs between reserve and release (concurrent PUTs of one key share the record).
    writers: int = 0

    def record(self) -> dict[str, object]:
        return {
            "v": 1,
            "model": self.key.model,
            "dtype": self.key.dtype,
            "hash": self.key.hash,
            "size": self.size,
            "crc32c": f"{self.crc32c:08x}",
            "queued_at": self.queued_at,
        }


UploadFn = Callable[[PendingUpload], Awaitable[None]]
DeleteFn = Callable[[EntryKey], Awaitable[None]]


class UploadQueue:
    """See the module docstring. ``load`` before the disk index is rebuilt (so pending
    entries are pinned before anything is evicted), ``reconcile`` after it."""

    def __init__(
        self,
        data_dir: Path,
        disk: DiskTier,
        upload: UploadFn,
        delete: DeleteFn,
        *,
        max_entries: int,
        max_bytes: int,
        workers: int,
        retry_min: float,
        retry_max: float,
        registry: CollectorRegistry,
    ) -> None:
        self.directory = data_dir / JOURNAL_DIR
        self.disk = disk
        self._upload = upload
        self._delete = delete
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.retry_min = retry_min
        self.retry_max = max(retry_max, retry_min)
        self._workers = workers
        self._items: dict[str, PendingUpload] = {}
        self.pending_bytes = 0
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_log = -math.inf
        self.metrics = UploadQueueMetrics(
            registry,
            depth=lambda: len(self),
            pending_bytes=lambda: self.pending_bytes,
            oldest_age=self.oldest_age,
        )

    def __len__(self) -> int:
        return len(self._items)

    # -- start-up ------------------------------------------------------------------

    def load(self) -> int:
        """Read the journal (blocking; run in a thread) and pin every pending entry."""
        self.directory.mkdir(parents=True, exist_ok=True)
        loaded = 0
        for path in sorted(self.directory.iterdir()):
            if path.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            try:
                item = self._parse(path)
            except (OSError, ValueError, KeyError, TypeError, InvalidKey) as exc:
                log.error("upload queue: dropping unreadable record %s: %s", path, exc)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if path.name != f"{item.key.digest}.json" or item.key.digest in self._items:
                log.error("upload queue: dropping misnamed record %s", path)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            self._items[item.key.digest] = item
            self.pending_bytes += item.size
            self.disk.pin(item.key)
            loaded += 1
        return loaded

    @staticmethod
    def _parse(path: Path) -> PendingUpload:
        raw = json.loads(path.read_text(encoding="utf-8"))
        key = EntryKey.parse(str(raw["model"]), str(raw["dtype"]), str(raw["hash"]))
        crc = str(raw["crc32c"])
        if len(crc) != 8:
            raise ValueError(f"bad crc32c {crc!r}")
        return PendingUpload(key, int(raw["size"]), int(crc, 16), float(raw["queued_at"]))

    def reconcile(self) -> int:
        """Drop records whose entry is not on disk (blocking). Returns how many remain."""
        for item in list(self._items.values()):
            if not self.disk.contains(item.key):
                log.warning(
                    "upload queue: %s is no longer on disk (PUT interrupted or deleted); "
                    "dropping its upload",
                    item.key,
                )
                self._forget(item)
        if self._items:
            log.info(
                "upload queue: %d entries (%d bytes) pending upload from the journal",
                len(self._items),
                self.pending_bytes,
            )
        return len(self._items)

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._update_idle()
        self._tasks = [
            asyncio.create_task(self._worker(), name=f"s3-upload-{n}") for n in range(self._workers)
        ]

    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Stop the workers, first giving pending uploads up to ``drain_timeout`` seconds
        (what is left stays in the journal for the next start)."""
        if drain_timeout > 0 and self._items and self._tasks:
            log.info(
                "upload queue: draining %d pending uploads (up to %.0fs) before stopping",
                len(self._items),
                drain_timeout,
            )
            self._retry_backing_off()  # a drain tries every upload now, not after its back-off
            if not await self.wait_idle(drain_timeout):
                log.warning(
                    "upload queue: %d uploads still pending at shutdown; they stay in %s "
                    "and resume at the next start",
                    len(self._items),
                    self.directory,
                )
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    # -- producers -------------------------------------------------------------------

    def has_room(self, size: int) -> bool:
        return len(self._items) < self.max_entries and self.pending_bytes + size <= self.max_bytes

    def contains(self, key: EntryKey) -> bool:
        return key.digest in self._items

    def reserve(self, key: EntryKey, size: int, crc32c: int) -> PendingUpload:
        """Register a PUT of ``key`` that is about to commit (event loop): the pending
        record, new or shared with a concurrent PUT of the same key, pinned on disk. Then
        :meth:`stage_record`, handed to the disk commit (which makes it durable first),
        and :meth:`release` after it, whatever happened."""
        item = self._items.get(key.digest)
        if item is None:
            # Not due until released with the entry on disk.
            item = PendingUpload(key, size, crc32c, time.time(), next_attempt=math.inf)
            self._items[key.digest] = item
            self.pending_bytes += size
            self.disk.pin(key)
            self._update_idle()
        item.writers += 1
        return item

    def stage_record(self, item: PendingUpload) -> StagedFile:
        """Write the record under a temp name (a few hundred bytes, page cache only);
        the disk tier's group commit syncs and renames it, in the batch of the entry
        and before the entry is published."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"{item.key.digest}.json"
        tmp = self.directory / f".{item.key.digest}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, json.dumps(item.record()).encode("utf-8"))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        return StagedFile(fd, tmp, final)

    def write_record(self, item: PendingUpload) -> None:
        """Journal the record durably (blocking)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"{item.key.digest}.json"
        tmp = self.directory / f".{item.key.digest}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, json.dumps(item.record()).encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        fsync_dir(self.directory)

    def activate(self, item: PendingUpload | None = None) -> None:
        """Make ``item`` due (its entry is committed) and wake a worker."""
        if item is not None:
            item.next_attempt = min(item.next_attempt, 0.0)
        if self._wake is not None:
            self._wake.set()

    def release(self, item: PendingUpload, *, on_disk: bool) -> None:
        """A PUT that reserved ``item`` is done. With the entry on disk (committed by this
        PUT or by anyone else) the upload becomes due — if S3 already has the object the
        worker finds out with one HEAD. Without it, the record goes once no other PUT
        holds it."""
        item.writers -= 1
        if self._items.get(item.key.digest) is not item:
            return  # discarded by a DELETE meanwhile
        if on_disk:
            self.activate(item)
        elif item.writers <= 0 and item.next_attempt == math.inf:
            self._forget(item)

    def discard(self, key: EntryKey) -> bool:
        """A DELETE: forget a pending upload. True when an upload is running right now
        (its object will be deleted again when it completes)."""
        item = self._items.get(key.digest)
        if item is None:
            return False
        if item.in_progress:
            item.deleted = True
            return True
        self._forget(item)
        return False

    def _forget(self, item: PendingUpload) -> None:
        if self._items.get(item.key.digest) is not item:
            return
        del self._items[item.key.digest]
        self.pending_bytes -= item.size
        with contextlib.suppress(FileNotFoundError):
            (self.directory / f"{item.key.digest}.json").unlink()
        self.disk.unpin(item.key)
        self._update_idle()

    def _update_idle(self) -> None:
        if self._idle is None:
            return
        if self._items:
            self._idle.clear()
        else:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Until nothing is pending (tests, graceful drains)."""
        if self._idle is None:
            return not self._items
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def snapshot(self) -> list[PendingUpload]:
        return list(self._items.values())

    # -- workers ---------------------------------------------------------------------

    def _next_due(self, now: float) -> tuple[PendingUpload | None, float | None]:
        soonest: float | None = None
        for item in self._items.values():
            if item.in_progress:
                continue
            if item.next_attempt <= now:
                return item, None
            if soonest is None or item.next_attempt < soonest:
                soonest = item.next_attempt
        return None, soonest

    async def _worker(self) -> None:
        assert self._wake is not None
        while True:
            item, soonest = self._next_due(time.monotonic())
            if item is None:
                self._wake.clear()
                timeout = None if soonest is None else max(0.0, soonest - time.monotonic())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            await self._attempt(item)

    def _log_failure(self, item: PendingUpload, delay: float, exc: Exception) -> None:
        """One line per failure while few fail; during an outage at most one summary
        line per ``LOG_INTERVAL`` (a full queue must not flood the log)."""
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL:
            log.debug("upload queue: upload of %s failed again: %s", item.key, exc)
            return
        self._last_log = now
        log.warning(
            "upload queue: upload of %s failed (attempt %d, retry in %.1fs); %d entries "
            "(%d bytes) waiting: %s",
            item.key,
            item.attempts,
            delay,
            len(self._items),
            self.pending_bytes,
            exc,
        )

    def oldest_age(self) -> float:
        """Seconds the longest-waiting entry has been pending (0 when none)."""
        if not self._items:
            return 0.0
        return max(0.0, time.time() - min(item.queued_at for item in self._items.values()))

    async def _attempt(self, item: PendingUpload) -> None:
        item.in_progress = True
        item.attempts += 1
        try:
            await self._upload(item)
        except EntryGone as exc:
            log.warning("upload queue: dropping %s: %s", item.key, exc)
            self.metrics.uploads.labels("dropped").inc()
            item.in_progress = False
            self._forget(item)
            return
        except asyncio.CancelledError:
            item.in_progress = False
            raise
        except Exception as exc:
            item.in_progress = False
            if item.deleted:  # a DELETE or purge ran during the failed upload: nothing to retry
                self._forget(item)
                return
            delay = min(self.retry_max, self.retry_min * 2 ** min(item.attempts - 1, 30))
            delay *= random.uniform(0.5, 1.0)
            item.next_attempt = time.monotonic() + delay
            item.last_error = str(exc)
            self.metrics.uploads.labels("retry").inc()
            self._log_failure(item, delay, exc)
            return
        item.in_progress = False
        self.metrics.uploads.labels("ok").inc()
        if item.deleted:  # a DELETE ran during the upload: honour it
            with contextlib.suppress(Exception):
                await self._delete(item.key)
        self._forget(item)
        self._retry_backing_off()  # S3 works: let everything that was backing off go now

    def _retry_backing_off(self) -> None:
        """Make every upload that failed before and waits for its retry due now."""
        now = time.monotonic()
        retry = False
        for other in self._items.values():
            if other.attempts and other.next_attempt > now:
                other.next_attempt = now
                retry = True
        if retry:
            self.activate()
