"""The data directory (``EC_DATA_DIR``) claimed by one server before anything in it is
touched: an exclusive lock, and a layout that start-up can work with.

A second server on the same directory would remove the first one's uploads in progress
as stray temp files, and both would evict and compact each other's index: so the
directory is locked (``flock`` on ``ec-cache.lock``, released by the kernel when the
process ends, however it ends) and a second server is refused. Then what is in the way
of start-up is set aside when it holds nothing of value (a ``tmp`` or ``keys.log.tmp``
that is not what it should be), and start-up is refused, naming the path, where it may
(``objects``, the write-back journal, running purges as plain files). Each refusal is a
``DataDirError`` whose message is one line that says what to do.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = "ec-cache.lock"
#: Folders whose contents matter: one that is something else stops start-up.
KEPT_DIRS = ("objects", "upload-queue", "purges")
#: Temp folder and file whose contents never matter: set aside when they are in the way.
TEMP_DIR = "tmp"
TEMP_FILE = "keys.log.tmp"


class DataDirError(Exception):
    """The data directory cannot be used; the message names the path and the remedy."""


def _kind(mode: int) -> str:
    return (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a plain file"
        if stat.S_ISREG(mode)
        else "not a directory"
    )


class DataDir:
    """``claim`` the directory for this process (see the module docstring); ``release``.
    ``check_layout`` alone is what a disk tier needs in a process that already owns
    the directory (tests that restart a tier in-process)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lock_path = root / LOCK_FILE
        self._fd: int | None = None

    def claim(self) -> None:
        """Create and lock the directory, then check its layout; idempotent.

        Raises ``DataDirError``."""
        if self._fd is not None:
            return
        self._lock()
        try:
            self.check_layout()
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the lock
            self._fd = None

    def _lock(self) -> None:
        root = self.root
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            raise DataDirError(
                f"EC_DATA_DIR {root} is not a directory: point EC_DATA_DIR at a directory"
            ) from None
        except OSError as exc:
            raise DataDirError(
                f"cannot use EC_DATA_DIR {root} ({exc.strerror}): give the server a "
                "directory it can create and write"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirError(
                f"EC_DATA_DIR {root} is in use by another ec-cache server (pid {holder}, "
                f"holding {self.lock_path}): stop it, or give this server its own EC_DATA_DIR"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def check_layout(self) -> None:
        """Set aside or refuse what is in the way of start-up; raises ``DataDirError``."""
        for name in KEPT_DIRS:
            path = self.root / name
            mode = _mode(path, follow_symlinks=True)  # may be a link to another disk
            if mode is not None and not stat.S_ISDIR(mode):
                raise DataDirError(
                    f"{path} is {_kind(mode)}, where the server keeps a directory: move "
                    "it out of EC_DATA_DIR (look at it first) and start again"
                )
        tmp = self.root / TEMP_DIR
        mode = _mode(tmp)
        if mode is not None and not stat.S_ISDIR(mode):
            self._set_aside(tmp, f"is {_kind(mode)}, where temp files are written")
        temp_file = self.root / TEMP_FILE
        mode = _mode(temp_file)
        if mode is not None and not stat.S_ISREG(mode):
            self._set_aside(temp_file, f"is {_kind(mode)}, where keys.log is compacted")

    def _set_aside(self, path: Path, why: str) -> None:
        aside = path.with_name(f"{path.name}.invalid-{time.time_ns()}")
        try:
            os.rename(path, aside)
        except OSError as exc:
            raise DataDirError(
                f"{path} {why}, and moving it aside failed ({exc.strerror}): remove it "
                "and start again"
            ) from None
        log.warning("%s %s: moved to %s (its contents are not needed)", path, why, aside)


def _mode(path: Path, *, follow_symlinks: bool = False) -> int | None:
    with contextlib.suppress(FileNotFoundError):
        return os.stat(path, follow_symlinks=follow_symlinks).st_mode
    return None
