"""The write-back journal: what each key owes S3, on disk, so that neither a restart nor
``kill -9`` loses an upload or a delete.

::

    {data_dir}/upload-queue/{key digest}.json     one small record per pending key

A record says what its key owes S3: the upload of its disk entry, a delete of its
object (``"deleted": true``), or both (a delete, then the upload of an entry PUT after
it). A PUT's record is staged (:meth:`UploadJournal.stage`) and made durable by the disk
tier's group commit in the batch of its entry, before the entry is published; a
DELETE's is written durably (:meth:`UploadJournal.write`, through
``file_sync.write_durably``) before the disk entry is removed. A record is removed
once S3 has done what it owes.

At start-up :meth:`UploadJournal.load` reads the records (dropping unreadable and
misnamed ones, and temp files of writes a crash interrupted) and
:meth:`UploadJournal.reconcile` matches them with the rebuilt disk tier: an upload whose
entry is not on disk (the PUT never completed, or the entry was deleted) is dropped,
and an entry whose record owes only a delete (its DELETE did not finish) is removed
from disk. The scheduler (``app.tiers.upload_scheduler``) owns what happens next.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from app.errors import InvalidKey
from app.keys import EntryKey
from app.tiers.disk import DiskTier, StagedFile
from app.tiers.disk.file_sync import write_durably

log = logging.getLogger(__name__)

JOURNAL_DIR = "upload-queue"


@dataclass
class PendingUpload:
    """What one key owes S3: its journal record, and the scheduler's state of its work."""

    key: EntryKey
    size: int
    crc32c: int
    queued_at: float  # wall clock, for operators
    attempts: int = 0
    next_attempt: float = 0.0  # monotonic
    last_error: str | None = None
    #: The entry committed on disk owes its upload.
    upload: bool = True
    #: A delete of the S3 object is owed (journaled), before any upload.
    deleted: bool = False
    #: The work in flight: "upload", "delete" or None.
    running: str | None = None
    #: DELETEs and purges that marked it: a delete sent before the last one does not
    #: settle it (the object may have been written again since).
    marks: int = 0
    #: DELETEs or purges journaling its record right now.
    journaling: int = 0
    #: PUTs between reserve and release (concurrent PUTs of one key share the record).
    writers: int = 0
    #: PUTs that reserved it so far: one during an upload (its entry committed after
    #: a lost upload dropped the disk copy) owes an upload of its own.
    reservations: int = 0

    def record(self) -> bytes:
        """The journal record's bytes."""
        return json.dumps(
            {
                "v": 1,
                "model": self.key.model,
                "dtype": self.key.dtype,
                "hash": self.key.hash,
                "size": self.size,
                "crc32c": f"{self.crc32c:08x}",
                "queued_at": self.queued_at,
                # A PUT's record becomes durable with its entry: it owes the upload.
                "upload": self.upload or self.writers > 0,
                "deleted": self.deleted,
            }
        ).encode("utf-8")


class UploadJournal:
    """The records in ``{data_dir}/upload-queue/``; see the module docstring."""

    def __init__(self, data_dir: Path) -> None:
        self.directory = data_dir / JOURNAL_DIR

    def path(self, key: EntryKey) -> Path:
        return self.directory / f"{key.digest}.json"

    # -- start-up --------------------------------------------------------------------

    def load(self) -> list[PendingUpload]:
        """The records (blocking); what cannot be read is dropped, and logged."""
        self.directory.mkdir(parents=True, exist_ok=True)
        items: dict[str, PendingUpload] = {}
        for path in sorted(self.directory.iterdir()):
            if path.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            try:
                item = self._parse(path)
            except (OSError, ValueError, KeyError, TypeError, InvalidKey) as exc:
                log.error("upload queue: dropping unreadable record %s: %s", path, exc)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if path != self.path(item.key) or item.key.digest in items:
                log.error("upload queue: dropping misnamed record %s", path)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            items[item.key.digest] = item
        return list(items.values())

    @staticmethod
    def _parse(path: Path) -> PendingUpload:
        raw = json.loads(path.read_text(encoding="utf-8"))
        key = EntryKey.parse(str(raw["model"]), str(raw["dtype"]), str(raw["hash"]))
        crc = str(raw["crc32c"])
        if len(crc) != 8:
            raise ValueError(f"bad crc32c {crc!r}")
        upload, deleted = raw.get("upload", True), raw.get("deleted", False)
        if not isinstance(upload, bool) or not isinstance(deleted, bool):
            raise ValueError("upload and deleted must be booleans")
        return PendingUpload(
            key,
            int(raw["size"]),
            int(crc, 16),
            float(raw["queued_at"]),
            upload=upload,
            deleted=deleted,
        )

    @staticmethod
    def reconcile(items: Iterable[PendingUpload], disk: DiskTier) -> None:
        """Match the records with the rebuilt disk (blocking): finish the DELETEs a
        crash interrupted (their disk entries go), drop the uploads whose entry is not
        on disk (``upload`` False, size 0)."""
        for item in items:
            on_disk = disk.contains(item.key)
            if item.deleted and not item.upload and on_disk:
                log.warning(
                    "upload queue: %s was being deleted when the server stopped: removing "
                    "its disk entry; its S3 object is deleted next",
                    item.key,
                )
                disk.delete(item.key)
            elif item.upload and not on_disk:
                log.warning(
                    "upload queue: %s is no longer on disk (PUT interrupted or deleted); "
                    "dropping its upload",
                    item.key,
                )
                item.upload = False
                item.size = 0

    # -- records ---------------------------------------------------------------------

    def stage(self, item: PendingUpload) -> StagedFile:
        """Write the record under a temp name (a few hundred bytes, page cache only);
        the disk tier's group commit syncs and renames it, in the batch of the entry
        and before the entry is published (blocking)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path(item.key)
        temp = self.directory / f".{final.name}.{uuid.uuid4().hex}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, item.record())
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
            raise
        return StagedFile(fd, temp, final)

    def write(self, item: PendingUpload) -> None:
        """Journal the record durably (blocking)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        write_durably(self.path(item.key), item.record())

    def remove(self, key: EntryKey) -> None:
        """The key owes nothing any more (not synced: a record found again after a
        crash costs one repeated conditional upload, or one repeated delete)."""
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()
