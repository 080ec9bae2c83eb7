"""The write-back scheduler: the uploads and deletes of S3 objects that the write-back
journal (``app.tiers.upload_journal``) records, bounded, retried with exponential
backoff, and the hiding of deleted keys.

In ``write-back`` mode a PUT answers 201 once the entry is committed to the disk tier; its
upload to S3 happens later, from here. A DELETE answers once the S3 delete it owes is
journaled (:meth:`UploadScheduler.mark_deleted`); the delete is made at once, or right
after an upload of the key in flight, and retried until S3 confirms it. A purge does
the same for the uploads of its namespace in flight, and waits for them
(:meth:`UploadScheduler.delete_namespace`). While a delete is owed, the key's S3 object
is never read (:meth:`UploadScheduler.hides`): nothing deleted comes back through a
read-through. The upload and the delete of one key never run at the same time. Every
pending key is pinned in the disk tier, so an entry is never evicted before it is
uploaded.

What an upload and a delete are is the write-back policy's
(``app.write_policy.WriteBackPolicy``), which hands them in as functions: the scheduler
knows keys, records and timing only.
It is bounded by entries and bytes; when it is full the policy does not drop anything:
it falls back to write-through for that PUT (which answers 503 if S3 is down).
Failures are retried with exponential backoff and jitter; one success resets the
backoff of all waiting keys, so the queue drains quickly once S3 is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable

import anyio.to_thread
from prometheus_client import CollectorRegistry

from app.keys import EntryKey
from app.metrics import UploadQueueMetrics
from app.retries import backoff
from app.tiers.disk import DiskTier, StagedFile
from app.tiers.upload_journal import PendingUpload, UploadJournal

log = logging.getLogger(__name__)

#: Seconds between upload-failure log lines while uploads keep failing.
LOG_INTERVAL = 30.0


class EntryGone(Exception):
    """The local entry to upload no longer exists (deleted, or corrupt and dropped)."""


#: Uploads an item's entry: True, or False when S3 held another body, which won.
UploadFn = Callable[[PendingUpload], Awaitable[bool]]
DeleteFn = Callable[[EntryKey], Awaitable[None]]


class UploadScheduler:
    """See the module docstring. ``load`` before the disk index is rebuilt (so pending
    entries are pinned before anything is evicted), ``reconcile`` after it."""

    def __init__(
        self,
        journal: UploadJournal,
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
        self.journal = journal
        self.disk = disk
        self._upload = upload
        self._delete = delete
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.retry_min = retry_min
        self.retry_max = max(retry_max, retry_min)
        self._workers = workers
        self._items: dict[str, PendingUpload] = {}
        #: Digests of the keys that owe a delete (their S3 objects are hidden).
        self._deleting: set[str] = set()
        self.pending_bytes = 0
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        #: Set (and replaced) whenever an item's work or writers change: what
        #: ``mark_deleted`` and ``delete_namespace`` wait on.
        self._changed: asyncio.Event | None = None
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

    @property
    def deletes_pending(self) -> int:
        """Keys whose S3 delete is owed."""
        return len(self._deleting)

    # -- start-up ------------------------------------------------------------------

    def load(self) -> int:
        """Read the journal (blocking; run in a thread) and pin every pending entry."""
        items = self.journal.load()
        for item in items:
            self._add(item)
            self._set_deleted(item, item.deleted)
        return len(items)

    def reconcile(self) -> int:
        """Match the journal with the disk (blocking; see ``UploadJournal.reconcile``).
        Returns how many keys remain."""
        self.journal.reconcile(list(self._items.values()), self.disk)
        self.pending_bytes = sum(item.size for item in self._items.values())
        for item in list(self._items.values()):
            self._retire(item)
        if self._items:
            log.info(
                "upload queue: %d keys (%d bytes) pending from the journal, %d of them "
                "owing an S3 delete",
                len(self._items),
                self.pending_bytes,
                len(self._deleting),
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
                "upload queue: draining %d pending uploads (and deletes; up to %.0fs) before stopping",
                len(self._items),
                drain_timeout,
            )
            self._retry_backing_off()  # a drain tries every upload now, not after its back-off
            if not await self.wait_idle(drain_timeout):
                log.warning(
                    "upload queue: %d keys still pending at shutdown; they stay in %s "
                    "and resume at the next start",
                    len(self._items),
                    self.journal.directory,
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

    def hides(self, key: EntryKey) -> bool:
        """Whether the key's S3 object must not be read: a delete of it is owed."""
        return bool(self._deleting) and key.digest in self._deleting

    def reserve(self, key: EntryKey, size: int, crc32c: int) -> PendingUpload:
        """Register a PUT of ``key`` that is about to commit (event loop): the pending
        record, new or shared with a concurrent PUT of the same key (or with a delete
        owed, which goes first), pinned on disk. Then :meth:`stage_record`, handed to
        the disk commit (which makes it durable first), and :meth:`release` after it,
        whatever happened."""
        item = self._items.get(key.digest)
        if item is None:
            # Not due until released by a PUT that created the entry.
            item = PendingUpload(key, size, crc32c, time.time(), next_attempt=math.inf)
            item.upload = False
            self._add(item)
        elif not item.upload and not item.writers:  # owes only a delete: this entry next
            self._resize(item, size)
            item.crc32c = crc32c
        item.writers += 1
        item.reservations += 1
        return item

    def stage_record(self, item: PendingUpload) -> StagedFile:
        """The record of a PUT about to commit, staged for the disk tier's group commit
        (``UploadJournal.stage``; blocking)."""
        return self.journal.stage(item)

    def activate(self, item: PendingUpload | None = None) -> None:
        """Make ``item`` due now and wake a worker."""
        if item is not None:
            item.next_attempt = min(item.next_attempt, 0.0)
        if self._wake is not None:
            self._wake.set()

    def release(self, item: PendingUpload, *, created: bool) -> None:
        """A PUT that reserved ``item`` is done. ``created``: its body became the entry
        (committed to disk), whose upload becomes due. Otherwise (it failed, or the key's
        entry was another's) the record goes once no other PUT holds it and it owes
        nothing else."""
        item.writers -= 1
        if self._items.get(item.key.digest) is not item:
            return
        if created:
            item.upload = True
            self.activate(item)
        self._pulse()
        self._retire(item)

    async def mark_deleted(self, key: EntryKey) -> PendingUpload:
        """A DELETE (or a purge) of ``key``: owe a delete of its S3 object, journaled
        before this returns, and drop its upload. From the call on, its S3 object is
        hidden and no upload of it starts before the delete; PUTs of it being committed
        are waited for (they come before this delete). The delete is due at once,
        unless an upload of the key is in flight: then right after it."""
        item = self._items.get(key.digest)
        if item is None:
            item = PendingUpload(key, 0, 0, time.time(), next_attempt=math.inf)
            item.upload = False
            self._add(item)
        self._set_deleted(item, True)
        item.marks += 1
        item.journaling += 1
        try:
            if item.running == "upload":
                log.info(
                    "upload queue: %s deleted while its upload is in flight: its S3 object "
                    "is deleted once that upload is over",
                    key,
                )
            while item.writers:
                await self._wait_change()
            item.upload = False
            self._resize(item, 0)
            await anyio.to_thread.run_sync(self.journal.write, item)
        finally:
            item.journaling -= 1
            self.activate(item)
        return item

    async def delete_now(self, item: PendingUpload) -> None:
        """Send the S3 delete ``item`` owes now rather than from a worker, unless an
        upload of it is in flight (a worker deletes right after it) or a worker is at it
        already (waited for). A failure is logged and retried by the workers."""
        if item.running == "delete":
            while item.running == "delete":
                await self._wait_change()
            return
        if item.running is None and item.deleted and self._items.get(item.key.digest) is item:
            await self._attempt(item, upload=False)

    async def delete_namespace(self, covers: Callable[[str, str], bool]) -> None:
        """A purge of the namespaces ``covers`` accepts: drop their uploads that have not
        started (the purge removes their entries, and from S3 whatever an earlier try
        stored); owe a delete (journaled) for those being committed or uploaded, and
        wait until those uploads are over, so that what they store in S3 is there before
        the purge deletes the namespace's objects."""
        busy = []
        for item in list(self._items.values()):
            if not covers(item.key.model, item.key.dtype):
                continue
            if item.running == "upload" or item.writers or item.journaling:
                busy.append(item)
                continue
            item.upload = False
            self._resize(item, 0)
            self._retire(item)
        if not busy:
            return
        log.info("upload queue: a purge waits for %d uploads of its namespace", len(busy))
        await asyncio.gather(*(self.mark_deleted(item.key) for item in busy))
        while any(item.running == "upload" for item in busy):
            await self._wait_change()

    # -- bookkeeping -------------------------------------------------------------------

    def _add(self, item: PendingUpload) -> PendingUpload:
        self._items[item.key.digest] = item
        self.pending_bytes += item.size
        self.disk.pin(item.key)
        self._update_idle()
        return item

    def _resize(self, item: PendingUpload, size: int) -> None:
        self.pending_bytes += size - item.size
        item.size = size

    def _set_deleted(self, item: PendingUpload, deleted: bool) -> None:
        item.deleted = deleted
        if deleted:
            self._deleting.add(item.key.digest)
        else:
            self._deleting.discard(item.key.digest)

    def _retire(self, item: PendingUpload) -> None:
        """Forget ``item`` once it owes nothing and nobody works on it."""
        if not (item.upload or item.deleted or item.writers or item.journaling or item.running):
            self._forget(item)

    def _forget(self, item: PendingUpload) -> None:
        if self._items.get(item.key.digest) is not item:
            return
        del self._items[item.key.digest]
        self._deleting.discard(item.key.digest)
        self.pending_bytes -= item.size
        self.journal.remove(item.key)
        self.disk.unpin(item.key)
        self._update_idle()

    def _pulse(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait_change(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

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

    # -- workers ---------------------------------------------------------------------

    def _next_due(self, now: float) -> tuple[PendingUpload | None, float | None]:
        soonest: float | None = None
        for item in self._items.values():
            if item.running or item.journaling:
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

    def _log_failure(self, item: PendingUpload, action: str, delay: float, exc: Exception) -> None:
        """One line per failure while few fail; during an outage at most one summary
        line per ``LOG_INTERVAL`` (a full queue must not flood the log)."""
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL:
            log.debug("upload queue: %s of %s failed again: %s", action, item.key, exc)
            return
        self._last_log = now
        log.warning(
            "upload queue: %s of %s failed (attempt %d, retry in %.1fs); %d keys "
            "(%d bytes, %d deletes) waiting: %s",
            action,
            item.key,
            item.attempts,
            delay,
            len(self._items),
            self.pending_bytes,
            len(self._deleting),
            exc,
        )

    def oldest_age(self) -> float:
        """Seconds the longest-waiting key has been pending (0 when none)."""
        if not self._items:
            return 0.0
        return max(0.0, time.time() - min(item.queued_at for item in self._items.values()))

    async def _attempt(self, item: PendingUpload, *, upload: bool = True) -> None:
        """Do what ``item`` owes: its delete, then (with ``upload``) its upload. A
        failure is retried after a back-off; a DELETE that marked it meanwhile makes
        its delete due at once."""
        marks, reservations = item.marks, item.reservations
        item.attempts += 1
        action = "delete" if item.deleted else "upload"
        try:
            if item.deleted:
                item.running = "delete"
                await self._delete(item.key)
                self.metrics.deletes.labels("ok").inc()
                log.log(
                    logging.INFO if item.attempts > 1 else logging.DEBUG,
                    "upload queue: S3 object of %s deleted (attempt %d)",
                    item.key,
                    item.attempts,
                )
                if item.marks == marks:  # else deleted again since: once more
                    self._set_deleted(item, False)
            if upload and item.upload and not item.deleted:
                action = "upload"
                item.running = "upload"
                stored = await self._upload(item)
                self.metrics.uploads.labels("ok" if stored else "lost").inc()
                # Else a DELETE dropped it, or a PUT reserved it since: a later PUT
                # may owe its own upload.
                if (item.marks, item.reservations) == (marks, reservations):
                    item.upload = False
        except EntryGone as exc:
            log.warning("upload queue: dropping the upload of %s: %s", item.key, exc)
            self.metrics.uploads.labels("dropped").inc()
            if (item.marks, item.reservations) == (marks, reservations):
                item.upload = False
            self._due_if_owing(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            delay = backoff(item.attempts, self.retry_min, self.retry_max)
            delay *= random.uniform(0.5, 1.0)
            item.last_error = str(exc)
            counter = self.metrics.deletes if action == "delete" else self.metrics.uploads
            counter.labels("retry").inc()
            self._log_failure(item, action, delay, exc)
            # A DELETE during a failed upload (whose outcome is unknown): delete now.
            item.next_attempt = time.monotonic() + delay if item.marks == marks else 0.0
        else:
            item.attempts = 0
            self._due_if_owing(item)
            self._retry_backing_off()  # S3 works: let everything that was backing off go now
        finally:
            item.running = None
            self._pulse()
            self._retire(item)
            self.activate()

    @staticmethod
    def _due_if_owing(item: PendingUpload) -> None:
        item.next_attempt = 0.0 if item.deleted or item.upload else math.inf

    def _retry_backing_off(self) -> None:
        """Make every key that failed before and waits for its retry due now."""
        now = time.monotonic()
        retry = False
        for other in self._items.values():
            if other.attempts and other.next_attempt > now:
                other.next_attempt = now
                retry = True
        if retry:
            self.activate()
