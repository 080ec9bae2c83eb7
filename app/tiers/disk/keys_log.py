"""``keys.log``: the key of every disk entry, one line each, so that the tier can list
and purge a namespace (model, dtype).

File names are digests of keys and cannot be turned back into keys, so each group
commit first appends the keys of its entries (``"{digest} {model} {dtype} {hash}"``, one
short line each, not synced) before the renames that publish them. The log is read back
and compacted at start-up, and compacted again when it has grown well past the index.
An entry whose line is missing (files from before the log existed, or a line lost to a
power cut) is *unattributed*: served as usual, counted apart, and removed by any purge.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from app.errors import InvalidKey
from app.keys import EntryKey
from app.tiers.disk.file_sync import write_durably

log = logging.getLogger(__name__)

KEYS_LOG = "keys.log"
_KEYS_LOST = (
    "the log is rebuilt, and the entries on disk whose keys it held are unattributed "
    "(served, counted apart, removed by any purge)"
)
#: Compact keys.log when it holds this many more lines than the index has entries.
KEYS_LOG_SLACK = 4096


def _key_line(key: EntryKey) -> bytes:
    return f"{key.digest} {key.model} {key.dtype} {key.hash}\n".encode()


class KeysLog:
    """The log under ``root``. Thread-safe: appends and compactions take turns."""

    def __init__(self, root: Path) -> None:
        self.path = root / KEYS_LOG
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._lines = 0

    def read(self) -> dict[str, EntryKey]:
        """The keys logged, by digest. A log that cannot be read (not a regular file,
        an I/O error) is reported, set aside if it is in the way, and rebuilt by the
        compaction that follows: its entries are unattributed (still served)."""
        keys: dict[str, EntryKey] = {}
        path = self.path
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

    def append(self, keys: Sequence[EntryKey], entries: int) -> bool:
        """Append the keys' lines (not synced: a line lost to a power cut leaves its
        entry unattributed, still served, and removed by any purge). True when the log
        should be compacted, its lines well past the ``entries`` of the index — once
        these entries are in the index, or their lines, not yet backed by an entry,
        would be dropped."""
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC)
            os.write(self._fd, b"".join(map(_key_line, keys)))
            self._lines += len(keys)
            return self._lines > 2 * entries + KEYS_LOG_SLACK

    def compact(self, present: Callable[[], list[EntryKey]]) -> None:
        """Rewrite the log with the lines of the keys ``present()`` answers (those of the
        entries in the index; asked with no append in between), atomically."""
        with self._lock:
            keys = present()
            path = self.path
            if not keys and not path.exists():
                return  # created by the first commit
            write_durably(path, b"".join(map(_key_line, keys)))
            if self._fd is not None:
                os.close(self._fd)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self._lines = len(keys)
