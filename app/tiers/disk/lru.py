"""The disk tier's index: its committed entries by key digest, least recently used
first, with the bytes they take, the pins that keep some of them, and the namespaces
they belong to (``namespaces``, kept in step with every change here).

The index lives in memory only; the tier rebuilds it from file names at start-up. Not
thread-safe: the tier uses it under its lock.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from app.keys import EntryKey
from app.safetensors_format import TensorHeader
from app.tiers.disk.namespaces import NamespaceIndex

#: What tells a changed file apart: (inode, size, mtime, ctime).
Signature = tuple[int, int, int, int]


def signature(st: os.stat_result) -> Signature:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class Entry:
    """A committed file."""

    path: Path
    size: int
    crc32c: int
    # Set once the file's bytes were checked against crc32c; stale if the file changed.
    verified: Signature | None = None
    header: TensorHeader | None = None
    #: None: unattributed (its keys.log line is missing).
    key: EntryKey | None = None


class LruIndex:
    """Entries by digest in LRU order; ``used`` bytes, ``pinned`` digests (with counts)
    that eviction passes over, and the eviction counters."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # LRU first
        self.namespaces = NamespaceIndex()
        self.pinned: dict[str, int] = {}
        self.used = 0
        self.evictions = 0
        self.evicted_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> Entry | None:
        return self._entries.get(digest)

    def touch(self, digest: str) -> None:
        """Mark the entry most recently used."""
        self._entries.move_to_end(digest)

    def add(self, digest: str, entry: Entry) -> None:
        """Add ``entry`` as the most recently used."""
        self._entries[digest] = entry
        self.namespaces.track(digest, entry.key, entry.size)
        self.used += entry.size

    def pop(self, digest: str) -> Entry | None:
        """Remove the entry (None: not there)."""
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self.namespaces.untrack(digest, entry.key, entry.size)
            self.used -= entry.size
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self.namespaces.clear()
        self.used = 0

    def known_keys(self) -> list[EntryKey]:
        """The keys of the entries whose key is known (``keys.log``'s lines)."""
        return [entry.key for entry in self._entries.values() if entry.key is not None]

    def evict(self, max_bytes: int, until_freed: int | None = None) -> list[Entry]:
        """Pop least recently used, unpinned entries until ``used`` is within
        ``max_bytes`` (or until ``until_freed`` bytes are freed); return them. Walks
        from the LRU end and stops early: never a copy of the whole index."""
        need = self.used - max_bytes if until_freed is None else until_freed
        chosen: list[str] = []
        freed = 0
        for digest, entry in self._entries.items():
            if freed >= need:
                break
            if digest not in self.pinned:
                chosen.append(digest)
                freed += entry.size
        victims = [victim for digest in chosen if (victim := self.pop(digest)) is not None]
        self.evictions += len(victims)
        self.evicted_bytes += freed
        return victims

    def pin(self, digest: str) -> None:
        self.pinned[digest] = self.pinned.get(digest, 0) + 1

    def unpin(self, digest: str) -> None:
        count = self.pinned.get(digest, 0) - 1
        if count > 0:
            self.pinned[digest] = count
        else:
            self.pinned.pop(digest, None)

    def pinned_bytes(self) -> int:
        """Bytes of the pinned entries present."""
        return sum(
            entry.size for digest in self.pinned if (entry := self._entries.get(digest)) is not None
        )
