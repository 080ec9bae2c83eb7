"""The group commit: the one thread that makes finished writes durable and publishes
them, a batch at a time.

A finished upload's file is ``fdatasync``ed at once, in parallel with the others
(``SYNC_THREADS``); its *name* is what is grouped: every upload handed over while a
batch is being committed joins the next one, which renames them into ``objects/``,
``fsync``s each directory it touched once (one file-system journal commit for the
batch, the classic group commit of databases) and only then publishes the entries and
answers their waiters. A crash never leaves a partial entry, readers never see a
half-written file, and a commit is answered only once its bytes and its directory entry
are on stable storage — unless the entry is a copy of what the backend holds
(``PendingWrite.durable`` False: a read-through fill, a write-through PUT once
uploaded), which is published without any sync: a power cut may lose it or leave it
torn, and the CRC32C check of its first read after start-up drops a torn one.

Files staged with an upload (:class:`StagedFile`: its write-back journal record) are
made durable and renamed into place in the same batch, before the entry is published.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.checksum import to_hex
from app.errors import InsufficientStorage
from app.metrics import DiskCommitMetrics
from app.safetensors_format import TensorHeader
from app.tiers.disk.file_sync import fsync_dir

if TYPE_CHECKING:
    from app.tiers.disk.pending import PendingWrite
    from app.tiers.disk.tier import DiskTier

log = logging.getLogger(__name__)

#: Threads that fdatasync finished uploads' files in parallel (the device works on
#: several at once; one thread syncing them in turn halved the PUT rate measured).
SYNC_THREADS = 16


@dataclass(eq=False)
class StagedFile:
    """A small file written under a temp name (``path``, still open as ``fd``) that the
    group commit syncs and renames to ``final`` before the entry it belongs to is
    published: the write-back journal record of that entry."""

    fd: int
    path: Path
    final: Path
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                os.close(self.fd)

    def discard(self) -> None:
        """Close and remove the temp file (a renamed one is the journal's to remove)."""
        self.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


@dataclass(eq=False)
class Commit:
    """One finished upload waiting for the group commit."""

    pending: PendingWrite
    crc: int
    header: TensorHeader
    staged: tuple[StagedFile, ...]
    future: Future[bool]
    final: Path | None = None
    error: BaseException | None = None
    fd_open: bool = True
    #: The fdatasync of its files, started when it was handed over.
    data: Future[None] | None = None

    def sync_data(self, metrics: DiskCommitMetrics) -> None:
        syncs = metrics.fsyncs
        for staged in self.staged:
            os.fdatasync(staged.fd)
            syncs.labels("file").inc()
        os.fdatasync(self.pending.fd)
        syncs.labels("file").inc()

    def close_fd(self) -> None:
        if self.fd_open:
            self.fd_open = False
            with contextlib.suppress(OSError):
                os.close(self.pending.fd)

    def discard(self) -> None:
        """Remove what this commit left behind (it failed or lost the race)."""
        self.close_fd()
        for staged in self.staged:
            staged.discard()
        for path in (self.pending.path, self.final):
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


class GroupCommitter:
    """The committer of ``tier``'s writes; see the module docstring. With ``delay`` > 0
    the thread also waits, up to ``delay`` seconds, while other temp files are still
    being written (like PostgreSQL's ``commit_delay``)."""

    def __init__(self, tier: DiskTier, delay: float, metrics: DiskCommitMetrics) -> None:
        self._tier = tier
        self._delay = delay
        self.metrics = metrics
        self._cond = threading.Condition()
        self._queue: list[Commit] = []
        self._writing = 0  # temp files begun and neither submitted nor aborted
        self._thread: threading.Thread | None = None
        self._syncer: ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def writing(self) -> int:
        return self._writing

    def started_writing(self) -> None:
        with self._cond:
            self._writing += 1

    def finished_writing(self) -> None:
        with self._cond:
            self._writing -= 1
            self._cond.notify()

    def submit(self, job: Commit) -> None:
        with self._cond:
            if self._syncer is None and not self._closed:
                self._syncer = ThreadPoolExecutor(SYNC_THREADS, "ec-disk-sync")
            syncer = None if self._closed else self._syncer
        # A loser of the first-writer race spares its fsyncs, and so does a copy of the
        # backend's entry; once closed, the batch syncs (see _commit_batch).
        pending = job.pending
        if syncer is not None and pending.durable and not self._tier.contains(pending.key):
            job.data = syncer.submit(job.sync_data, self.metrics)
        with self._cond:
            self._writing -= 1
            if not self._closed:
                self._queue.append(job)
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="ec-disk-commit", daemon=True
                    )
                    self._thread.start()
                self._cond.notify()
                return
        self._commit_batch([job])  # closed (shutting down): commit in this thread

    def close(self) -> None:
        """Commit what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        if self._syncer is not None:
            self._syncer.shutdown()

    def _next_batch(self) -> list[Commit] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            if self._delay > 0:
                deadline = time.monotonic() + self._delay
                while self._writing > 0 and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            batch, self._queue = self._queue, []
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._commit_batch(batch)
            except BaseException as exc:  # a bug: fail the waiters rather than hang them
                log.exception("group commit failed")
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(exc)

    def _commit_batch(self, batch: list[Commit]) -> None:
        """Make a batch of finished uploads durable, then publish them (committer
        thread), in rounds: each publishes the first upload of each key (see
        ``_commit_round``); the others of that key wait for it, and are answered False
        only once it is published (readable), or take its place in another round if
        it failed (what their PUT's client expects: a valid body stored)."""
        for job in batch:
            if job.data is not None:  # never close a file while it is being synced
                with contextlib.suppress(OSError):
                    job.data.result()
        jobs = []
        for job in batch:
            if job.future.set_running_or_notify_cancel():
                jobs.append(job)
            else:
                job.discard()  # its PUT went away before the batch started
        while jobs:
            jobs = self._commit_round(jobs)

    def _commit_round(self, batch: list[Commit]) -> list[Commit]:
        """Commit the first upload of each key of ``batch`` not yet stored; return the
        others of the keys whose first upload failed. Order: (1) wait for the
        ``fdatasync`` of every temp file and journal record, started in parallel when
        each was handed over; (2) rename the records, ``fsync`` their directory once;
        (3) append the key lines, rename the entries into ``objects/``, ``fsync`` each
        directory touched once; (4) publish the entries in the index and answer. A
        failure fails only the commits it touched, and what they left is removed;
        nothing is visible before step 4. Entries that are not ``durable`` skip the
        syncs of steps 1 and 3 (a new shard directory is synced all the same: later
        entries, durable ones too, go there)."""
        tier = self._tier
        started = time.perf_counter()
        jobs: list[Commit] = []
        #: Later uploads of a key this round commits, by digest: answered after it.
        waiting: dict[str, list[Commit]] = {}
        for job in batch:
            pending = job.pending
            digest = pending.key.digest
            if digest in waiting:
                waiting[digest].append(job)
                continue
            if tier.contains(pending.key):
                job.discard()  # first writer wins (its entry is readable): spare the fsyncs
                job.future.set_result(False)
                continue
            if pending.written > tier.max_bytes:
                job.error = InsufficientStorage(
                    f"entry of {pending.written} bytes is larger than the disk tier "
                    f"({tier.max_bytes} bytes)"
                )
            waiting[digest] = []
            jobs.append(job)
        # (1) the bytes: synced in parallel since each was handed over (see submit),
        # here when that was skipped (the key existed then, and is gone since)
        for job in jobs:
            if job.error is None:
                try:
                    if job.data is not None:
                        job.data.result()
                    elif job.pending.durable:
                        job.sync_data(self.metrics)
                except OSError as exc:
                    job.error = exc
            job.close_fd()
            for staged in job.staged:
                staged.close()
        # (2) the journal records, durable before their entries are visible
        record_dirs: dict[Path, list[Commit]] = {}
        for job in jobs:
            if job.error is None:
                try:
                    for staged in job.staged:
                        os.rename(staged.path, staged.final)
                        record_dirs.setdefault(staged.final.parent, []).append(job)
                except OSError as exc:
                    job.error = exc
        self._sync_dirs(record_dirs)
        # (3) the entries' names
        live = [job for job in jobs if job.error is None]
        entry_dirs: dict[Path, list[Commit]] = {}
        compact = False
        if live:
            try:
                compact = tier.log_keys([job.pending.key for job in live])
            except OSError as exc:
                for job in live:
                    job.error = exc
                live = []
        for job in live:
            digest = job.pending.key.digest
            final = tier.objects / digest[:2] / f"{digest}.{to_hex(job.crc)}.safetensors"
            try:
                if not final.parent.is_dir():
                    final.parent.mkdir(exist_ok=True)
                    # A new shard directory is itself a new name in objects/.
                    entry_dirs.setdefault(tier.objects, []).append(job)
                os.rename(job.pending.path, final)
            except OSError as exc:
                job.error = exc
                continue
            job.final = final
            if job.pending.durable:
                entry_dirs.setdefault(final.parent, []).append(job)
        self._sync_dirs(entry_dirs)
        # (4) publish
        tier.publish(jobs)
        if compact:
            tier.compact_keys_log()
        if jobs:
            self.metrics.batch_size.observe(len(jobs))
            self.metrics.seconds.observe(time.perf_counter() - started)
        retry: list[Commit] = []
        for job in jobs:
            later = waiting[job.pending.key.digest]
            if job.error is not None:
                job.discard()
                job.future.set_exception(job.error)
                retry += later
                continue
            job.future.set_result(True)
            for loser in later:
                loser.discard()
                loser.future.set_result(False)
        return retry

    def _sync_dirs(self, dirs: dict[Path, list[Commit]]) -> None:
        """``fsync`` each directory once; a failure fails the commits that renamed
        into it."""
        for directory, jobs in dirs.items():
            if all(job.error is not None for job in jobs):
                continue
            try:
                fsync_dir(directory)
                self.metrics.fsyncs.labels("directory").inc()
            except OSError as exc:
                for job in jobs:
                    if job.error is None:
                        job.error = exc
