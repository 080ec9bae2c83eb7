"""The disk tier: a bytes-bounded LRU of committed files under one directory.

Layout (the name is a digest of the key because hashes may exceed NAME_MAX)::

    {data_dir}/objects/{digest[:2]}/{digest}.{crc32c hex}.safetensors
    {data_dir}/tmp/        in-flight writes, removed at start-up
    {data_dir}/keys.log    "{digest} {model} {dtype} {hash}" per entry (namespaces)

Writes go to ``tmp/``, each batch's writeback started as it is written (see
``start_writeback``); a finished upload's file is ``fdatasync``ed at once, in
parallel with the others, and then published by one committer thread in *group
commits*: every upload handed over while a batch is being committed joins the next
one, which renames them into ``objects/``, ``fsync``s each directory it touched once
(one file-system journal commit for the batch) and only then publishes the entries and
answers their waiters. A crash never leaves a partial entry, readers never see a
half-written file, and a commit is answered only once its bytes and its directory
entry are on stable storage — unless the entry is a copy of what the backend holds
(``PendingWrite.durable`` False: a read-through fill, a write-through PUT once
uploaded), which is published without any sync: a power cut may lose it or leave it
torn, and the CRC32C check of its first read after start-up drops a torn one. Committed
files are immutable; each is served by ``mmap`` and its CRC32C re-verified whenever
its (inode, size, mtime, ctime) changes, so bytes changed on disk are caught and the
entry dropped. The index lives in memory and is rebuilt from file names at start-up.

File names cannot be turned back into keys, so each commit first appends its key to
``keys.log`` (one short line, before the rename that publishes the entry); the log is
read back and compacted at start-up and when it has grown well past the index. It is
what lets the tier list and purge a namespace (model, dtype). An entry whose line is
missing (files from before the log existed, or a line lost to a power cut) is
*unattributed*: served as usual, counted apart, and removed by any purge.
All methods are synchronous and thread-safe; the store runs slow ones in threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import re
import stat
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from app.checksum import crc32c, to_hex
from app.errors import ECError, InsufficientStorage, InvalidKey, Unavailable
from app.keys import EntryKey, key_digests
from app.metrics import DiskCommitMetrics
from app.safetensors_format import (
    TensorHeader,
    parse_header,
    read_header_length,
    validate_body,
)
from app.tiers.base import EntryBody, EntryInfo

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^([0-9a-f]{64})\.([0-9a-f]{8})\.safetensors$")
KEYS_LOG = "keys.log"
_KEYS_LOST = (
    "the log is rebuilt, and the entries on disk whose keys it held are unattributed "
    "(served, counted apart, removed by any purge)"
)
#: Compact keys.log when it holds this many more lines than the index has entries.
KEYS_LOG_SLACK = 4096
Namespace = tuple[str, str]
_Signature = tuple[int, int, int, int]
#: Kept free beyond a body's own bytes when making room for it (file system metadata).
SPACE_SLACK_BYTES = 1024 * 1024


def _iov_max() -> int:
    """The most buffers one ``writev`` takes (more: EINVAL); 1024 on Linux."""
    try:
        limit = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError):
        return 1024
    return limit if limit > 0 else 1024


IOV_MAX = _iov_max()


def _signature(st: os.stat_result) -> _Signature:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class _Entry:
    path: Path
    size: int
    crc32c: int
    # Set once the file's bytes were checked against crc32c; stale if the file changed.
    verified: _Signature | None = None
    header: TensorHeader | None = None
    #: None: unattributed (its keys.log line is missing).
    key: EntryKey | None = None


@dataclass
class DiskStats:
    entries: int
    used_bytes: int
    max_bytes: int
    evictions: int
    evicted_bytes: int
    corrupt_removed: int
    pinned: int
    #: Group commits done, and the entries they made durable (their ratio: batch size).
    commit_batches: int = 0
    committed_entries: int = 0
    #: Temp files being written (uploads and S3 fills not yet handed to the committer).
    writes_in_flight: int = 0


@dataclass(frozen=True)
class NamespaceUsage:
    """Entries and bytes of one namespace on this disk (model and dtype None:
    unattributed entries)."""

    model: str | None
    dtype: str | None
    entries: int
    bytes: int


@dataclass(frozen=True)
class ListedEntry:
    hash: str
    size: int
    crc32c: int
    header: TensorHeader | None


@dataclass
class OpenedEntry:
    """A committed file mapped into memory; ``verified`` says whether its CRC was checked."""

    key: EntryKey
    entry: _Entry
    view: mmap.mmap
    signature: _Signature
    verified: bool

    def body(self) -> EntryBody:
        assert self.entry.header is not None
        info = EntryInfo(self.entry.size, self.entry.crc32c, self.entry.header, "disk")
        return EntryBody(info, buffer=memoryview(self.view))


@dataclass(eq=False)
class PendingWrite:
    """A temp file being filled (made by ``create``, after ``DiskTier.reserve_write``);
    ``commit`` publishes it, ``abort`` removes it."""

    tier: DiskTier
    key: EntryKey
    fd: int
    path: Path
    written: int = 0
    done: bool = field(default=False)
    #: The body's whole length once known (Content-Length, or its safetensors header):
    #: space for what is still to come is reserved against other uploads.
    expected: int | None = None
    #: False for a copy of what the backend already holds: its bytes are not pushed to
    #: the device early and its commit syncs nothing (see the module docstring). Read
    #: by each write and by the commit: set before the body is written, or to True
    #: before the commit (its fdatasync then writes what was not pushed early).
    durable: bool = True

    @property
    def remaining(self) -> int:
        """Bytes still to be written that this upload has reserved."""
        return max((self.expected or 0) - self.written, 0)

    def expect(self, total: int) -> None:
        """Learn the body's length: refuse it now (nothing evicted) if it cannot fit."""
        if self.expected is None:
            self.tier._reserve(self, total)

    def create(self) -> None:
        """Create the temp file (see ``DiskTier.reserve_write``)."""
        fd, name = tempfile.mkstemp(dir=self.tier._tmp, prefix="put-", suffix=".part")
        self.fd, self.path = fd, Path(name)

    def write(self, chunks: Sequence[bytes | bytearray | memoryview]) -> None:
        """Append ``chunks``, at most ``IOV_MAX`` of them per ``writev`` (a body received
        in small pieces hands over thousands per batch). On a full file system, evict
        least recently used entries once per batch, and only when the rest of the body
        can fit once they are gone: a body that cannot fit is refused (507) with every
        entry left in place."""
        views = [memoryview(chunk) for chunk in chunks]
        first = 0  # views before it are written
        evicted = False
        while first < len(views):
            try:
                n = os.writev(self.fd, views[first : first + IOV_MAX])
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                needed = max(self.remaining, sum(len(view) for view in views[first:]))
                if evicted or not self.tier._make_room(self, needed):
                    raise InsufficientStorage(
                        f"the disk tier's file system is full ({exc.strerror})"
                    ) from None
                evicted = True
                continue
            if self.durable:
                start_writeback(self.fd, self.written, n)
            with self.tier._lock:
                self.written += n
            while first < len(views) and n >= len(views[first]):
                n -= len(views[first])
                first += 1
            if n:
                views[first] = views[first][n:]

    def submit(
        self, crc: int, header: TensorHeader, staged: Sequence[StagedFile] = ()
    ) -> Future[bool]:
        """Hand the file to the group commit; the future says whether it was published
        once its batch is committed (and the file durable, if ``durable``), or raises.
        False (nothing stored): the key's entry exists and is readable, that of an
        earlier upload of the same batch once published; if that one fails, this one
        is committed instead.
        ``staged`` files (a write-back journal record) are made durable and renamed
        into place, in the same batch, before the entry is published."""
        self.done = True
        self.tier._unreserve(self)
        job = _Commit(self, crc, header, tuple(staged), Future())
        self.tier._committer.submit(job)
        return job.future

    def commit(self, crc: int, header: TensorHeader) -> bool:
        """Publish the file (blocking until its batch is committed); False (and nothing
        stored) when the key already exists."""
        return self.submit(crc, header).result()

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        self.tier._unreserve(self)
        self.tier._committer.finished_writing()
        if self.fd < 0:
            return  # its file was never created
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


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
class _Commit:
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


#: Threads that fdatasync finished uploads' files in parallel (the device works on
#: several at once; one thread syncing them in turn halved the PUT rate measured).
SYNC_THREADS = 16


class _GroupCommitter:
    """The thread that makes finished uploads durable, a batch at a time.

    Each upload's bytes are fdatasync'ed as soon as it is handed over, in parallel
    (``SYNC_THREADS``); its name is what is grouped: uploads handed over while a batch
    is being committed wait for the next one, whose renames share one ``fsync`` of
    each directory touched and so one file-system journal commit (the classic group
    commit of databases). With
    ``delay`` > 0 the thread also waits, up to ``delay`` seconds, while other temp
    files are still being written (like PostgreSQL's ``commit_delay``).
    """

    def __init__(self, tier: DiskTier, delay: float) -> None:
        self._tier = tier
        self._delay = delay
        self._cond = threading.Condition()
        self._queue: list[_Commit] = []
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

    def submit(self, job: _Commit) -> None:
        with self._cond:
            if self._syncer is None and not self._closed:
                self._syncer = ThreadPoolExecutor(SYNC_THREADS, "ec-disk-sync")
            syncer = None if self._closed else self._syncer
        # A loser of the first-writer race spares its fsyncs, and so does a copy of the
        # backend's entry; once closed, the batch syncs (see _commit_batch).
        pending = job.pending
        if syncer is not None and pending.durable and not self._tier.contains(pending.key):
            job.data = syncer.submit(job.sync_data, self._tier._commit_metrics)
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
        self._tier._commit_batch([job])  # closed (shutting down): commit in this thread

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

    def _next_batch(self) -> list[_Commit] | None:
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
                self._tier._commit_batch(batch)
            except BaseException as exc:  # a bug: fail the waiters rather than hang them
                log.exception("group commit failed")
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(exc)


class DiskTier:
    """Bounded LRU of immutable safetensors files; see the module docstring."""

    name = "disk"

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        statvfs: Callable[[Path], os.statvfs_result] = os.statvfs,
        *,
        commit_delay: float = 0.0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._statvfs = statvfs
        self._writes: set[PendingWrite] = set()  # in flight, with their reservations
        self._objects = root / "objects"
        self._tmp = root / "tmp"
        self._lock = threading.Lock()
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # digest -> entry, LRU first
        self._pinned: dict[str, int] = {}
        self._used = 0
        self._evictions = 0
        self._evicted_bytes = 0
        self._corrupt_removed = 0
        # namespace -> {hash: digest}; and the digests of unattributed entries
        self._namespaces: dict[Namespace, dict[str, str]] = {}
        self._namespace_bytes: dict[Namespace, int] = {}
        self._unattributed: dict[str, int] = {}
        self._keys_lock = threading.Lock()
        self._keys_fd: int | None = None
        self._keys_lines = 0
        self._committer = _GroupCommitter(self, commit_delay)
        self._commit_metrics = DiskCommitMetrics(registry or CollectorRegistry())
        self._commit_batches = 0
        self._committed_entries = 0

    def close(self) -> None:
        """Finish the commits handed over and stop the committer thread."""
        self._committer.close()

    # -- start-up -----------------------------------------------------------------

    def rebuild(self) -> None:
        """Create the folders, drop stray temp files and load the index from disk."""
        self._objects.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        for stray in self._tmp.iterdir():
            log.info("removing stray temp file %s", stray)
            with contextlib.suppress(OSError):
                stray.unlink()
        found: list[tuple[int, str, _Entry]] = []
        for shard in self._objects.iterdir():
            for item in os.scandir(shard) if shard.is_dir() else ():
                match = _NAME_RE.match(item.name)
                st = item.stat(follow_symlinks=False)
                if match is None or not item.is_file(follow_symlinks=False):
                    log.warning("removing unexpected file %s", item.path)
                    with contextlib.suppress(OSError):
                        os.unlink(item.path)
                    continue
                entry = _Entry(Path(item.path), st.st_size, int(match.group(2), 16))
                found.append((max(st.st_atime_ns, st.st_mtime_ns), match.group(1), entry))
        found.sort(key=lambda item: item[0])
        keys = self._read_keys_log()
        with self._lock:
            self._index.clear()
            self._namespaces.clear()
            self._namespace_bytes.clear()
            self._unattributed.clear()
            self._used = 0
            for _, digest, entry in found:
                if digest in self._index:  # only possible after tampering: keep the first
                    with contextlib.suppress(OSError):
                        entry.path.unlink()
                    continue
                entry.key = keys.get(digest)
                self._index[digest] = entry
                self._track_locked(digest, entry)
                self._used += entry.size
            victims = self._evict_locked()
        self._unlink(victims)
        self._compact_keys_log()
        log.info(
            "disk tier: %d entries, %d of %d bytes", len(self._index), self._used, self.max_bytes
        )

    # -- reads --------------------------------------------------------------------

    def contains(self, key: EntryKey) -> bool:
        with self._lock:
            return key.digest in self._index

    def contains_hashes(self, model: str, dtype: str, hashes: Sequence[str]) -> list[bool]:
        """Presence of many validated hashes of one model and dtype, in order. An entry
        whose key is known is found in its namespace's map under one lock acquisition,
        with no key hashed (``key_digest`` is most of the cost of a batch of 1000
        otherwise). Only while unattributed entries exist (their keys.log lines lost)
        are the hashes not found there looked up by digest too."""
        with self._lock:
            members = self._namespaces.get((model, dtype))
            present = [h in members for h in hashes] if members else [False] * len(hashes)
            if not self._unattributed or all(present):
                return present
        missing = [index for index, found in enumerate(present) if not found]
        digests = key_digests(model, dtype, [hashes[index] for index in missing])
        with self._lock:
            for index, digest in zip(missing, digests, strict=True):
                present[index] = digest in self._index
        return present

    def open(self, key: EntryKey) -> OpenedEntry | None:
        """Map the entry's file; None on a miss. Marks the entry most recently used."""
        with self._lock:
            entry = self._index.get(key.digest)
            if entry is None:
                return None
            self._index.move_to_end(key.digest)
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # evicted or deleted since the lookup
            return None
        try:
            st = os.fstat(fd)
            view = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ) if st.st_size else None
            if view is not None:  # start reading ahead a cold file before it is sent
                view.madvise(mmap.MADV_WILLNEED)
        finally:
            os.close(fd)
        signature = _signature(st)
        if view is None:
            self._drop_corrupt(key, entry, "file is empty")
            return None
        return OpenedEntry(key, entry, view, signature, entry.verified == signature)

    def verify(self, opened: OpenedEntry) -> OpenedEntry | None:
        """Check the mapped bytes against the stored CRC32C; drop the entry if they differ."""
        entry = opened.entry
        reason = None
        if opened.signature[1] != entry.size:
            reason = f"size is {opened.signature[1]}, expected {entry.size}"
        elif crc32c(memoryview(opened.view)) != entry.crc32c:
            reason = "CRC32C mismatch"
        else:
            try:
                header = validate_body(memoryview(opened.view), opened.key.dtype)
            except ECError as exc:
                reason = f"not a valid entry: {exc.message}"
        if reason is not None:
            self._drop_corrupt(opened.key, entry, reason)
            return None
        entry.header = header
        entry.verified = opened.signature
        opened.verified = True
        return opened

    def info(self, key: EntryKey) -> EntryInfo | None:
        """The entry's description if known without reading the file, else None."""
        with self._lock:
            entry = self._index.get(key.digest)
        if entry is None or entry.header is None:
            return None
        return EntryInfo(entry.size, entry.crc32c, entry.header, self.name)

    # -- writes -------------------------------------------------------------------

    def begin_write(self, key: EntryKey, expected_size: int | None = None) -> PendingWrite:
        """A temp file for a new entry; with ``expected_size``, refused at once (507, or
        503 while other uploads hold the space) when the body cannot fit."""
        pending = self.reserve_write(key, expected_size)
        try:
            pending.create()
        except BaseException:
            pending.abort()
            raise
        return pending

    def reserve_write(
        self, key: EntryKey, expected_size: int | None = None, *, durable: bool = True
    ) -> PendingWrite:
        """``begin_write`` without the temp file, which ``PendingWrite.create`` makes
        (file-system work that can block): quick enough for the event loop, so that a
        body that cannot fit is refused before any of it is read. ``durable``: see
        ``PendingWrite.durable``."""
        pending = PendingWrite(self, key, -1, self._tmp, durable=durable)
        if expected_size is not None:
            self._reserve(pending, expected_size)
        self._committer.started_writing()
        return pending

    # -- space: never evict for a body that cannot fit -------------------------------

    def _check_fits_locked(self, pending: PendingWrite, needed: int) -> int:
        """Raise when ``needed`` more bytes cannot fit: 507 when they never can (free
        space plus what eviction could free), 503 when only the bytes other uploads in
        flight have reserved are in the way. Else return the free bytes not reserved."""
        if pending.written + needed > self.max_bytes:
            raise InsufficientStorage(
                f"entry of {pending.written + needed} bytes is larger than the disk tier "
                f"({self.max_bytes} bytes)"
            )
        st = self._statvfs(self._tmp)
        free = st.f_bavail * st.f_frsize
        reserved = sum(other.remaining for other in self._writes if other is not pending)
        if needed <= free - reserved:
            return free - reserved  # the common case: no need to count evictable bytes
        pinned = sum(
            entry.size for digest in self._pinned if (entry := self._index.get(digest)) is not None
        )
        evictable = self._used - pinned
        if needed > free + evictable:
            raise InsufficientStorage(
                f"entry needs {needed} more bytes: the disk tier's file system has {free} "
                f"free and eviction could free {evictable}"
            )
        if needed > free + evictable - reserved:
            raise Unavailable(
                f"entry needs {needed} more bytes and other uploads in flight reserve "
                f"{reserved} of the {free + evictable} the disk tier can free: retry",
                retry_after=1,
            )
        return free - reserved

    def _reserve(self, pending: PendingWrite, total: int) -> None:
        with self._lock:
            self._check_fits_locked(pending, max(total - pending.written, 0))
            pending.expected = total
            self._writes.add(pending)

    def _unreserve(self, pending: PendingWrite) -> None:
        with self._lock:
            self._writes.discard(pending)

    def _make_room(self, pending: PendingWrite, needed: int) -> bool:
        """After ENOSPC: evict just enough for ``needed`` more bytes (plus slack) if they
        can fit once evicted; raise (nothing evicted) if they cannot."""
        with self._lock:
            unreserved_free = self._check_fits_locked(pending, needed)
            victims = self._evict_locked(
                until_freed=max(needed - unreserved_free, 0) + SPACE_SLACK_BYTES
            )
        self._unlink(victims)
        return bool(victims)

    def _commit_batch(self, batch: list[_Commit]) -> None:
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

    def _commit_round(self, batch: list[_Commit]) -> list[_Commit]:
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
        started = time.perf_counter()
        jobs: list[_Commit] = []
        #: Later uploads of a key this round commits, by digest: answered after it.
        waiting: dict[str, list[_Commit]] = {}
        for job in batch:
            pending = job.pending
            digest = pending.key.digest
            if digest in waiting:
                waiting[digest].append(job)
                continue
            if self.contains(pending.key):
                job.discard()  # first writer wins (its entry is readable): spare the fsyncs
                job.future.set_result(False)
                continue
            if pending.written > self.max_bytes:
                job.error = InsufficientStorage(
                    f"entry of {pending.written} bytes is larger than the disk tier "
                    f"({self.max_bytes} bytes)"
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
                        job.sync_data(self._commit_metrics)
                except OSError as exc:
                    job.error = exc
            job.close_fd()
            for staged in job.staged:
                staged.close()
        # (2) the journal records, durable before their entries are visible
        record_dirs: dict[Path, list[_Commit]] = {}
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
        entry_dirs: dict[Path, list[_Commit]] = {}
        compact = False
        if live:
            try:
                compact = self._log_keys([job.pending.key for job in live])
            except OSError as exc:
                for job in live:
                    job.error = exc
                live = []
        for job in live:
            digest = job.pending.key.digest
            final = self._objects / digest[:2] / f"{digest}.{to_hex(job.crc)}.safetensors"
            try:
                if not final.parent.is_dir():
                    final.parent.mkdir(exist_ok=True)
                    # A new shard directory is itself a new name in objects/.
                    entry_dirs.setdefault(self._objects, []).append(job)
                os.rename(job.pending.path, final)
            except OSError as exc:
                job.error = exc
                continue
            job.final = final
            if job.pending.durable:
                entry_dirs.setdefault(final.parent, []).append(job)
        self._sync_dirs(entry_dirs)
        # (4) publish
        published: list[_Commit] = []
        with self._lock:
            for job in jobs:
                if job.error is not None or job.final is None:
                    continue
                pending = job.pending
                try:
                    signature = _signature(os.stat(job.final))
                except OSError as exc:
                    job.error = exc
                    continue
                entry = _Entry(
                    job.final, pending.written, job.crc, signature, job.header, pending.key
                )
                self._index[pending.key.digest] = entry
                self._track_locked(pending.key.digest, entry)
                self._used += pending.written
                published.append(job)
            victims = self._evict_locked() if published else []
            if jobs:
                self._commit_batches += 1
                self._committed_entries += len(published)
        self._unlink(victims)
        if compact:
            self._compact_keys_log()
        if jobs:
            self._commit_metrics.batch_size.observe(len(jobs))
            self._commit_metrics.seconds.observe(time.perf_counter() - started)
        retry: list[_Commit] = []
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

    def _sync_dirs(self, dirs: dict[Path, list[_Commit]]) -> None:
        """``fsync`` each directory once; a failure fails the commits that renamed
        into it."""
        for directory, jobs in dirs.items():
            if all(job.error is not None for job in jobs):
                continue
            try:
                fsync_dir(directory)
                self._commit_metrics.fsyncs.labels("directory").inc()
            except OSError as exc:
                for job in jobs:
                    if job.error is None:
                        job.error = exc

    def delete(self, key: EntryKey) -> bool:
        with self._lock:
            entry = self._index.pop(key.digest, None)
            if entry is not None:
                self._untrack_locked(key.digest, entry)
                self._used -= entry.size
        if entry is None:
            return False
        self._unlink([entry])
        return True

    # -- pinning: entries that must stay until another tier has them ---------------

    def pin(self, key: EntryKey) -> None:
        with self._lock:
            self._pinned[key.digest] = self._pinned.get(key.digest, 0) + 1

    def unpin(self, key: EntryKey) -> None:
        with self._lock:
            count = self._pinned.get(key.digest, 0) - 1
            if count > 0:
                self._pinned[key.digest] = count
            else:
                self._pinned.pop(key.digest, None)
            victims = self._evict_locked()
        self._unlink(victims)

    # -- housekeeping -------------------------------------------------------------

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(
                entries=len(self._index),
                used_bytes=self._used,
                max_bytes=self.max_bytes,
                evictions=self._evictions,
                evicted_bytes=self._evicted_bytes,
                corrupt_removed=self._corrupt_removed,
                pinned=len(self._pinned),
                commit_batches=self._commit_batches,
                committed_entries=self._committed_entries,
                writes_in_flight=self._committer.writing,
            )

    def _evict_locked(self, until_freed: int | None = None) -> list[_Entry]:
        """Pop least recently used, unpinned entries until within the bound (or until
        ``until_freed`` bytes are freed). Walks the index from its LRU end and stops
        early: never a copy of the whole index under the lock."""
        need = self._used - self.max_bytes if until_freed is None else until_freed
        chosen: list[str] = []
        freed = 0
        for digest, entry in self._index.items():
            if freed >= need:
                break
            if digest not in self._pinned:
                chosen.append(digest)
                freed += entry.size
        victims = [self._index.pop(digest) for digest in chosen]
        for digest, entry in zip(chosen, victims, strict=True):
            self._untrack_locked(digest, entry)
        self._used -= freed
        self._evictions += len(victims)
        self._evicted_bytes += freed
        return victims

    def _drop_corrupt(self, key: EntryKey, entry: _Entry, reason: str) -> None:
        log.warning("disk entry %s is corrupt (%s): removing it", key, reason)
        with self._lock:
            if self._index.get(key.digest) is entry:
                del self._index[key.digest]
                self._untrack_locked(key.digest, entry)
                self._used -= entry.size
                self._corrupt_removed += 1
            else:
                return
        self._unlink([entry])

    # -- namespaces -----------------------------------------------------------------

    def _track_locked(self, digest: str, entry: _Entry) -> None:
        if entry.key is None:
            self._unattributed[digest] = entry.size
            return
        namespace = (entry.key.model, entry.key.dtype)
        self._namespaces.setdefault(namespace, {})[entry.key.hash] = digest
        self._namespace_bytes[namespace] = self._namespace_bytes.get(namespace, 0) + entry.size

    def _untrack_locked(self, digest: str, entry: _Entry) -> None:
        if entry.key is None:
            self._unattributed.pop(digest, None)
            return
        namespace = (entry.key.model, entry.key.dtype)
        members = self._namespaces.get(namespace)
        if members is None or members.pop(entry.key.hash, None) is None:
            return
        if members:
            self._namespace_bytes[namespace] -= entry.size
        else:
            del self._namespaces[namespace]
            del self._namespace_bytes[namespace]

    def holds_namespace(self, model: str, dtype: str) -> bool:
        """Whether entries of the namespace (model, dtype) are here."""
        with self._lock:
            return (model, dtype) in self._namespaces

    def namespaces(self) -> tuple[list[NamespaceUsage], NamespaceUsage]:
        """Usage per namespace (sorted), and that of the unattributed entries."""
        with self._lock:
            usage = [
                NamespaceUsage(model, dtype, len(members), self._namespace_bytes[(model, dtype)])
                for (model, dtype), members in self._namespaces.items()
            ]
            unattributed = NamespaceUsage(
                None, None, len(self._unattributed), sum(self._unattributed.values())
            )
        usage.sort(key=lambda u: (u.model or "", u.dtype or ""))
        return usage, unattributed

    def list_namespace(
        self, model: str, dtype: str, after: str | None, limit: int
    ) -> tuple[list[ListedEntry], str | None]:
        """Up to ``limit`` entries of a namespace with hashes after ``after``, in hash
        order, and the cursor of the next page (None at the end). Reads the headers of
        entries not described since start-up (a few KiB each): call from a thread."""
        with self._lock:
            members = self._namespaces.get((model, dtype), {})
            hashes = sorted(h for h in members if after is None or h > after)
            page = hashes[:limit]
            entries = [(h, self._index[members[h]]) for h in page]
        listed = [
            ListedEntry(h, e.size, e.crc32c, e.header or _read_header(e.path, dtype))
            for h, e in entries
        ]
        return listed, (page[-1] if len(hashes) > limit else None)

    def purge(self, model: str, dtype: str | None) -> tuple[int, int]:
        """Remove every entry of ``model`` (of ``dtype``, or of every dtype when None)
        and every unattributed entry; returns (entries, bytes) removed. Idempotent."""
        with self._lock:
            digests = [
                digest
                for (m, d), members in self._namespaces.items()
                if m == model and (dtype is None or d == dtype)
                for digest in members.values()
            ]
            digests += list(self._unattributed)
            victims = []
            for digest in digests:
                entry = self._index.pop(digest, None)
                if entry is not None:
                    self._untrack_locked(digest, entry)
                    self._used -= entry.size
                    victims.append(entry)
        self._unlink(victims)
        return len(victims), sum(entry.size for entry in victims)

    # -- keys.log -------------------------------------------------------------------

    def _read_keys_log(self) -> dict[str, EntryKey]:
        """The keys logged, by digest. A log that cannot be read (not a regular file,
        an I/O error) is reported, set aside if it is in the way, and rebuilt by the
        compaction that follows: its entries are unattributed (still served)."""
        keys: dict[str, EntryKey] = {}
        path = self.root / KEYS_LOG
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                aside = path.with_name(f"{KEYS_LOG}.invalid-{time.time_ns()}")
                os.rename(path, aside)
                log.error("%s is not a regular file: moved to %s; %s", path, aside, _KEYS_LOST)
                return keys
            text = path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return keys
        except OSError as exc:
            log.error("cannot read %s (%s); %s", path, exc, _KEYS_LOST)
            return keys
        for line in text.splitlines():
            parts = line.split(" ")
            if len(parts) != 4:
                continue  # a torn last line after a crash
            try:
                key = EntryKey.parse(parts[1], parts[2], parts[3])
            except InvalidKey:
                continue
            if key.digest == parts[0]:
                keys[key.digest] = key
        return keys

    @staticmethod
    def _key_line(key: EntryKey) -> bytes:
        return f"{key.digest} {key.model} {key.dtype} {key.hash}\n".encode()

    def _log_keys(self, keys: Sequence[EntryKey]) -> bool:
        """Append the keys' lines (not synced: a line lost to a power cut leaves its
        entry unattributed, still served, and removed by any purge). True when the log
        should be compacted — once these entries are in the index, or their lines,
        not yet backed by an entry, would be dropped."""
        with self._keys_lock:
            if self._keys_fd is None:
                self._keys_fd = os.open(
                    self.root / KEYS_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                )
            os.write(self._keys_fd, b"".join(map(self._key_line, keys)))
            self._keys_lines += len(keys)
            return self._keys_lines > 2 * len(self._index) + KEYS_LOG_SLACK

    def _compact_keys_log(self) -> None:
        """Rewrite keys.log with the lines of the entries present (atomically)."""
        with self._keys_lock:
            with self._lock:
                keys = [entry.key for entry in self._index.values() if entry.key is not None]
            path = self.root / KEYS_LOG
            if not keys and not path.exists():
                return  # created by the first commit
            temp = self.root / (KEYS_LOG + ".tmp")
            with open(temp, "wb") as out:
                out.write(b"".join(map(self._key_line, keys)))
                out.flush()
                os.fsync(out.fileno())
            os.rename(temp, path)
            fsync_dir(self.root)
            if self._keys_fd is not None:
                os.close(self._keys_fd)
            self._keys_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self._keys_lines = len(keys)

    @staticmethod
    def _unlink(entries: Iterable[_Entry]) -> None:
        # Readers that already mapped a file keep their pages: unlink is safe under them.
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                entry.path.unlink()


def _read_header(path: Path, dtype: str) -> TensorHeader | None:
    """The safetensors header of a committed file (None if unreadable or gone)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = read_header_length(prefix)
            return parse_header(f.read(length), dtype)
    except (OSError, ECError, struct.error):
        return None


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):  # not Linux
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


_sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` bytes at ``offset`` of ``fd`` to the device, without
    waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; nothing elsewhere).

    A body's bytes then stream to the disk while the rest of it is received, as with
    RocksDB's ``bytes_per_sync`` or PostgreSQL's ``backend_flush_after``, and the
    ``fdatasync`` that makes the upload durable finds little left to write: measured
    here, 16 concurrent 4.7 MB PUTs went from ~690 to ~850 MB/s. A hint only: its
    result is ignored, durability still comes from the ``fdatasync``."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
