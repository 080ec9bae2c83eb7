"""The disk tier: a bytes-bounded LRU of committed files under one directory.

Layout (the name is a digest of the key because hashes may exceed NAME_MAX)::

    {data_dir}/objects/{digest[:2]}/{digest}.{crc32c hex}.safetensors
    {data_dir}/tmp/        in-flight writes, removed at start-up
    {data_dir}/keys.log    the key of each entry (``keys_log``)
    {data_dir}/ec-cache.lock  held by the server that owns the directory (``data_dir``)

Writes go to ``tmp/`` (``pending``) and are published by the group commit
(``group_commit``), which makes them durable first. Committed files are immutable; each
is served by ``mmap`` and its CRC32C re-verified whenever its (inode, size, mtime,
ctime) changes, so bytes changed on disk are caught and the entry dropped. The index
(``lru``) lives in memory and is rebuilt from file names at start-up. A body that cannot
fit is refused before anything is evicted for it (the space of writes in flight is
reserved). All methods are synchronous and thread-safe; the store runs slow ones in
threads.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from app.checksum import crc32c
from app.errors import ECError, InsufficientStorage, Unavailable
from app.keys import EntryKey, key_digests
from app.metrics import DiskCommitMetrics
from app.safetensors_format import validate_body
from app.tiers.base import EntryBody, EntryInfo
from app.tiers.disk.data_dir import DataDir
from app.tiers.disk.group_commit import Commit, GroupCommitter
from app.tiers.disk.keys_log import KeysLog
from app.tiers.disk.lru import Entry, LruIndex, Signature, signature
from app.tiers.disk.namespaces import ListedEntry, NamespaceUsage, read_header
from app.tiers.disk.pending import PendingWrite

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^([0-9a-f]{64})\.([0-9a-f]{8})\.safetensors$")
#: Kept free beyond a body's own bytes when making room for it (file system metadata).
SPACE_SLACK_BYTES = 1024 * 1024


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


@dataclass
class OpenedEntry:
    """A committed file mapped into memory; ``verified`` says whether its CRC was checked."""

    key: EntryKey
    entry: Entry
    view: mmap.mmap
    signature: Signature
    verified: bool

    def body(self) -> EntryBody:
        assert self.entry.header is not None
        info = EntryInfo(self.entry.size, self.entry.crc32c, self.entry.header, "disk")
        return EntryBody(info, buffer=memoryview(self.view))


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
        self.objects = root / "objects"
        self.tmp = root / "tmp"
        self.data_dir = DataDir(root)
        self._statvfs = statvfs
        self._writes: set[PendingWrite] = set()  # in flight, with their reservations
        self._lock = threading.Lock()
        self._index = LruIndex()
        self._corrupt_removed = 0
        self._keys_log = KeysLog(root)
        self.committer = GroupCommitter(
            self, commit_delay, DiskCommitMetrics(registry or CollectorRegistry())
        )
        self._commit_batches = 0
        self._committed_entries = 0

    def close(self) -> None:
        """Finish the commits handed over, stop the committer thread and release the
        data directory."""
        self.committer.close()
        self.data_dir.release()

    # -- start-up -----------------------------------------------------------------

    def claim(self) -> None:
        """Lock the data directory for this process and check its layout (before anything
        in it is touched: the server does this ahead of start-up). Raises
        ``DataDirError`` with a one-line message."""
        self.data_dir.claim()

    def rebuild(self) -> None:
        """Create the folders, drop stray temp files and load the index from disk."""
        self.data_dir.check_layout()
        self.objects.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        for stray in self.tmp.iterdir():
            log.info("removing stray temp file %s", stray)
            with contextlib.suppress(OSError):
                stray.unlink()
        found: list[tuple[int, str, Entry]] = []
        for shard in self.objects.iterdir():
            for item in os.scandir(shard) if shard.is_dir() else ():
                match = _NAME_RE.match(item.name)
                st = item.stat(follow_symlinks=False)
                if match is None or not item.is_file(follow_symlinks=False):
                    log.warning("removing unexpected file %s", item.path)
                    with contextlib.suppress(OSError):
                        os.unlink(item.path)
                    continue
                entry = Entry(Path(item.path), st.st_size, int(match.group(2), 16))
                found.append((max(st.st_atime_ns, st.st_mtime_ns), match.group(1), entry))
        found.sort(key=lambda item: item[0])
        keys = self._keys_log.read()
        with self._lock:
            self._index.clear()
            for _, digest, entry in found:
                if digest in self._index:  # only possible after tampering: keep the first
                    with contextlib.suppress(OSError):
                        entry.path.unlink()
                    continue
                entry.key = keys.get(digest)
                self._index.add(digest, entry)
            victims = self._index.evict(self.max_bytes)
        self._unlink(victims)
        self.compact_keys_log()
        log.info(
            "disk tier: %d entries, %d of %d bytes",
            len(self._index),
            self._index.used,
            self.max_bytes,
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
            namespaces = self._index.namespaces
            members = namespaces.members(model, dtype)
            present = [h in members for h in hashes] if members else [False] * len(hashes)
            if not namespaces.has_unattributed or all(present):
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
            self._index.touch(key.digest)
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
        found = signature(st)
        if view is None:
            self._drop_corrupt(key, entry, "file is empty")
            return None
        return OpenedEntry(key, entry, view, found, entry.verified == found)

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
        pending = PendingWrite(self, key, -1, self.tmp, durable=durable)
        if expected_size is not None:
            self.reserve_space(pending, expected_size)
        self.committer.started_writing()
        return pending

    # -- space: never evict for a body that cannot fit (PendingWrite's calls) ---------

    def _check_fits_locked(self, pending: PendingWrite, needed: int) -> int:
        """Raise when ``needed`` more bytes cannot fit: 507 when they never can (free
        space plus what eviction could free), 503 when only the bytes other uploads in
        flight have reserved are in the way. Else return the free bytes not reserved."""
        if pending.written + needed > self.max_bytes:
            raise InsufficientStorage(
                f"entry of {pending.written + needed} bytes is larger than the disk tier "
                f"({self.max_bytes} bytes)"
            )
        st = self._statvfs(self.tmp)
        free = st.f_bavail * st.f_frsize
        reserved = sum(other.remaining for other in self._writes if other is not pending)
        if needed <= free - reserved:
            return free - reserved  # the common case: no need to count evictable bytes
        evictable = self._index.used - self._index.pinned_bytes()
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

    def reserve_space(self, pending: PendingWrite, total: int) -> None:
        """Reserve the space of a body of ``total`` bytes, or refuse it (see above)."""
        with self._lock:
            self._check_fits_locked(pending, max(total - pending.written, 0))
            pending.expected = total
            self._writes.add(pending)

    def release_space(self, pending: PendingWrite) -> None:
        with self._lock:
            self._writes.discard(pending)

    def count_written(self, pending: PendingWrite, count: int) -> None:
        """``count`` more bytes of ``pending`` are written (its reservation shrinks)."""
        with self._lock:
            pending.written += count

    def make_room(self, pending: PendingWrite, needed: int) -> bool:
        """After ENOSPC: evict just enough for ``needed`` more bytes (plus slack) if they
        can fit once evicted; raise (nothing evicted) if they cannot."""
        with self._lock:
            unreserved_free = self._check_fits_locked(pending, needed)
            victims = self._index.evict(
                self.max_bytes, until_freed=max(needed - unreserved_free, 0) + SPACE_SLACK_BYTES
            )
        self._unlink(victims)
        return bool(victims)

    # -- the group commit's calls ---------------------------------------------------

    def log_keys(self, keys: Sequence[EntryKey]) -> bool:
        """Append the keys of entries about to be published to keys.log; True when the
        log should be compacted once they are published."""
        return self._keys_log.append(keys, len(self._index))

    def compact_keys_log(self) -> None:
        """Rewrite keys.log with the keys of the entries present."""

        def present() -> list[EntryKey]:
            with self._lock:
                return self._index.known_keys()

        self._keys_log.compact(present)

    def publish(self, jobs: Sequence[Commit]) -> None:
        """Add the entries the group commit renamed into place (``final`` set, no
        ``error``) to the index, evicting past the bound; a file that cannot be stat'ed
        fails its commit."""
        published = 0
        with self._lock:
            for job in jobs:
                if job.error is not None or job.final is None:
                    continue
                pending = job.pending
                try:
                    found = signature(os.stat(job.final))
                except OSError as exc:
                    job.error = exc
                    continue
                entry = Entry(job.final, pending.written, job.crc, found, job.header, pending.key)
                self._index.add(pending.key.digest, entry)
                published += 1
            victims = self._index.evict(self.max_bytes) if published else []
            if jobs:
                self._commit_batches += 1
                self._committed_entries += published
        self._unlink(victims)

    # -- removal --------------------------------------------------------------------

    def delete(self, key: EntryKey) -> bool:
        with self._lock:
            entry = self._index.pop(key.digest)
        if entry is None:
            return False
        self._unlink([entry])
        return True

    def _drop_corrupt(self, key: EntryKey, entry: Entry, reason: str) -> None:
        log.warning("disk entry %s is corrupt (%s): removing it", key, reason)
        with self._lock:
            if self._index.get(key.digest) is not entry:
                return
            self._index.pop(key.digest)
            self._corrupt_removed += 1
        self._unlink([entry])

    @staticmethod
    def _unlink(entries: Iterable[Entry]) -> None:
        # Readers that already mapped a file keep their pages: unlink is safe under them.
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                entry.path.unlink()

    # -- pinning: entries that must stay until another tier has them ---------------

    def pin(self, key: EntryKey) -> None:
        with self._lock:
            self._index.pin(key.digest)

    def unpin(self, key: EntryKey) -> None:
        with self._lock:
            self._index.unpin(key.digest)
            victims = self._index.evict(self.max_bytes)
        self._unlink(victims)

    # -- housekeeping -------------------------------------------------------------

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(
                entries=len(self._index),
                used_bytes=self._index.used,
                max_bytes=self.max_bytes,
                evictions=self._index.evictions,
                evicted_bytes=self._index.evicted_bytes,
                corrupt_removed=self._corrupt_removed,
                pinned=len(self._index.pinned),
                commit_batches=self._commit_batches,
                committed_entries=self._committed_entries,
                writes_in_flight=self.committer.writing,
            )

    # -- namespaces -----------------------------------------------------------------

    def holds_namespace(self, model: str, dtype: str) -> bool:
        """Whether entries of the namespace (model, dtype) are here."""
        with self._lock:
            return self._index.namespaces.holds(model, dtype)

    def namespaces(self) -> tuple[list[NamespaceUsage], NamespaceUsage]:
        """Usage per namespace (sorted), and that of the unattributed entries."""
        with self._lock:
            return self._index.namespaces.usage()

    def list_namespace(
        self, model: str, dtype: str, after: str | None, limit: int
    ) -> tuple[list[ListedEntry], str | None]:
        """Up to ``limit`` entries of a namespace with hashes after ``after``, in hash
        order, and the cursor of the next page (None at the end). Reads the headers of
        entries not described since start-up (a few KiB each): call from a thread."""
        with self._lock:
            page, cursor = self._index.namespaces.page(model, dtype, after, limit)
            entries = [
                (h, entry) for h, digest in page if (entry := self._index.get(digest)) is not None
            ]
        listed = [
            ListedEntry(h, e.size, e.crc32c, e.header or read_header(e.path, dtype))
            for h, e in entries
        ]
        return listed, cursor

    def purge(self, model: str, dtype: str | None) -> tuple[int, int]:
        """Remove every entry of ``model`` (of ``dtype``, or of every dtype when None)
        and every unattributed entry; returns (entries, bytes) removed. Idempotent."""
        with self._lock:
            digests = self._index.namespaces.purged(model, dtype)
            victims = [
                entry for digest in digests if (entry := self._index.pop(digest)) is not None
            ]
        self._unlink(victims)
        return len(victims), sum(entry.size for entry in victims)
