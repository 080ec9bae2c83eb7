"""A write in progress: the temp file of one upload or read-through fill, until the
group commit (``group_commit``) publishes it or it is aborted.

Its space is reserved against other writes as soon as its length is known (the tier
refuses a body that cannot fit before any of it is read); its bytes are pushed towards
the device as they are written (``file_sync.start_writeback``) unless it is a copy of
what the backend already holds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from app.errors import InsufficientStorage
from app.keys import EntryKey
from app.safetensors_format import TensorHeader
from app.tiers.disk.file_sync import start_writeback
from app.tiers.disk.group_commit import Commit, StagedFile

if TYPE_CHECKING:
    from app.tiers.disk.tier import DiskTier


def _iov_max() -> int:
    """The most buffers one ``writev`` takes (more: EINVAL); 1024 on Linux."""
    try:
        limit = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError):
        return 1024
    return limit if limit > 0 else 1024


IOV_MAX = _iov_max()


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
    #: the device early and its commit syncs nothing (see ``group_commit``). Read by
    #: each write and by the commit: set before the body is written, or to True before
    #: the commit (its fdatasync then writes what was not pushed early).
    durable: bool = True

    @property
    def remaining(self) -> int:
        """Bytes still to be written that this upload has reserved."""
        return max((self.expected or 0) - self.written, 0)

    def expect(self, total: int) -> None:
        """Learn the body's length: refuse it now (nothing evicted) if it cannot fit."""
        if self.expected is None:
            self.tier.reserve_space(self, total)

    def create(self) -> None:
        """Create the temp file (see ``DiskTier.reserve_write``)."""
        fd, name = tempfile.mkstemp(dir=self.tier.tmp, prefix="put-", suffix=".part")
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
                if evicted or not self.tier.make_room(self, needed):
                    raise InsufficientStorage(
                        f"the disk tier's file system is full ({exc.strerror})"
                    ) from None
                evicted = True
                continue
            if self.durable:
                start_writeback(self.fd, self.written, n)
            self.tier.count_written(self, n)
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
        self.tier.release_space(self)
        job = Commit(self, crc, header, tuple(staged), Future())
        self.tier.committer.submit(job)
        return job.future

    def commit(self, crc: int, header: TensorHeader) -> bool:
        """Publish the file (blocking until its batch is committed); False (and nothing
        stored) when the key already exists."""
        return self.submit(crc, header).result()

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        self.tier.release_space(self)
        self.tier.committer.finished_writing()
        if self.fd < 0:
            return  # its file was never created
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
