"""The namespaces (model, dtype) of the disk entries: which entries each holds, and
their bytes.

A second index over the LRU's entries (``lru`` keeps the two in step), built from the
keys ``keys_log`` recorded. It lets the tier answer a batch existence check by hash
without hashing keys, report usage per namespace, list a namespace page by page and
find what a purge removes. An entry whose key is unknown is *unattributed*: counted
apart, and removed by any purge. Not thread-safe: the tier uses it under its lock.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from app.errors import ECError
from app.keys import EntryKey
from app.safetensors_format import TensorHeader, parse_header, read_header_length

Namespace = tuple[str, str]


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


class NamespaceIndex:
    """Entry digests by namespace and hash, the bytes of each namespace, and the
    unattributed entries."""

    def __init__(self) -> None:
        self._members: dict[Namespace, dict[str, str]] = {}  # {hash: digest}
        self._bytes: dict[Namespace, int] = {}
        self._unattributed: dict[str, int] = {}  # digest -> size

    def track(self, digest: str, key: EntryKey | None, size: int) -> None:
        """An entry of ``size`` bytes (key None: unattributed) joined the index."""
        if key is None:
            self._unattributed[digest] = size
            return
        namespace = (key.model, key.dtype)
        self._members.setdefault(namespace, {})[key.hash] = digest
        self._bytes[namespace] = self._bytes.get(namespace, 0) + size

    def untrack(self, digest: str, key: EntryKey | None, size: int) -> None:
        """An entry :meth:`track` saw left the index."""
        if key is None:
            self._unattributed.pop(digest, None)
            return
        namespace = (key.model, key.dtype)
        members = self._members.get(namespace)
        if members is None or members.pop(key.hash, None) is None:
            return
        if members:
            self._bytes[namespace] -= size
        else:
            del self._members[namespace]
            del self._bytes[namespace]

    def clear(self) -> None:
        self._members.clear()
        self._bytes.clear()
        self._unattributed.clear()

    def holds(self, model: str, dtype: str) -> bool:
        return (model, dtype) in self._members

    def members(self, model: str, dtype: str) -> Mapping[str, str] | None:
        """Digests of the namespace's entries by hash (None: no entry)."""
        return self._members.get((model, dtype))

    @property
    def has_unattributed(self) -> bool:
        return bool(self._unattributed)

    def usage(self) -> tuple[list[NamespaceUsage], NamespaceUsage]:
        """Usage per namespace (sorted), and that of the unattributed entries."""
        usage = [
            NamespaceUsage(model, dtype, len(members), self._bytes[(model, dtype)])
            for (model, dtype), members in self._members.items()
        ]
        unattributed = NamespaceUsage(
            None, None, len(self._unattributed), sum(self._unattributed.values())
        )
        usage.sort(key=lambda u: (u.model or "", u.dtype or ""))
        return usage, unattributed

    def page(
        self, model: str, dtype: str, after: str | None, limit: int
    ) -> tuple[list[tuple[str, str]], str | None]:
        """(hash, digest) of up to ``limit`` entries of a namespace with hashes after
        ``after``, in hash order, and the cursor of the next page (None at the end)."""
        members = self._members.get((model, dtype), {})
        hashes = sorted(h for h in members if after is None or h > after)
        page = hashes[:limit]
        return [(h, members[h]) for h in page], (page[-1] if len(hashes) > limit else None)

    def purged(self, model: str, dtype: str | None) -> list[str]:
        """Digests a purge of ``model`` (of ``dtype``, or of every dtype when None)
        removes: its entries and every unattributed one."""
        digests = [
            digest
            for (m, d), members in self._members.items()
            if m == model and (dtype is None or d == dtype)
            for digest in members.values()
        ]
        return digests + list(self._unattributed)


def read_header(path: Path, dtype: str) -> TensorHeader | None:
    """The safetensors header of a committed file (None if unreadable or gone), to
    describe an entry listed before it was read since start-up."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = read_header_length(prefix)
            return parse_header(f.read(length), dtype)
    except (OSError, ECError, struct.error):
        return None
