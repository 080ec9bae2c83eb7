"""The order of the syncs and renames that make writes durable, observed as it happens.

Every ``fsync``, ``fdatasync`` and ``rename`` of the process is recorded (with the path
behind each file descriptor) while a write runs, and so is the moment the disk tier
publishes an entry; the tests then check the order the durability contract needs:

* a file's bytes are synced before its name is renamed into place;
* a directory is synced after the renames into it and before anything depending on
  them is visible (an entry published, a write returning);
* a write-back journal record is renamed and its directory synced before the entry
  it belongs to is renamed into ``objects/``;

and that a failing directory sync leaves nothing visible. Moving a sync after the
publish (or dropping it) fails one of them.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.checksum import crc32c
from app.keys import EntryKey
from app.namespaces import Purges
from app.safetensors_format import validate_body
from app.tiers.disk import DiskTier, StagedFile, file_sync, group_commit
from app.tiers.disk.file_sync import write_durably
from app.tiers.upload_journal import PendingUpload, UploadJournal
from app.write_policy import DiskOnlyPolicy
from testkit.entries import body

Event = tuple[str, ...]


class Recorder:
    """The syncs, renames and publishes of the process, in order (thread-safe)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def add(self, *event: str) -> None:
        with self._lock:
            self.events.append(event)

    def index(self, *event: str) -> int:
        """Where ``event`` happened (the test fails when it never did)."""
        with self._lock:
            assert event in self.events, f"{event} never happened; seen: {self.events}"
            return self.events.index(event)


def _path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to name a file descriptor's path")
    rec = Recorder()
    real_fsync, real_fdatasync, real_rename = os.fsync, os.fdatasync, os.rename

    def fsync(fd: int) -> None:
        rec.add("fsync", _path_of(fd))
        real_fsync(fd)

    def fdatasync(fd: int) -> None:
        rec.add("fdatasync", _path_of(fd))
        real_fdatasync(fd)

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        real_rename(src, dst)
        rec.add("rename", os.fspath(src), os.fspath(dst))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "rename", rename)
    yield rec


def _key(name: str) -> EntryKey:
    return EntryKey.parse("m", "uint8", name)


@pytest.fixture
def tier(tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> Iterator[DiskTier]:
    disk = DiskTier(tmp_path / "data", max_bytes=10_000_000)
    disk.rebuild()
    publish = disk.publish

    def recorded_publish(jobs: list[group_commit.Commit]) -> None:
        publish(jobs)
        for job in jobs:
            if job.error is None:
                recorder.add("publish", job.pending.key.hash)

    monkeypatch.setattr(disk, "publish", recorded_publish)
    yield disk
    disk.close()


def _stage(directory: Path, name: str, data: bytes) -> StagedFile:
    """A journal record staged as the write-back queue stages one."""
    directory.mkdir(parents=True, exist_ok=True)
    temp = directory / f".{name}.{uuid.uuid4().hex}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, data)
    return StagedFile(fd, temp, directory / name)


def _submit(tier: DiskTier, name: str, data: bytes, staged: tuple[StagedFile, ...] = ()) -> bool:
    pending = tier.begin_write(_key(name), len(data))
    pending.write([data])
    temp = os.fspath(pending.path)
    try:
        return pending.submit(crc32c(data), validate_body(data, "uint8"), staged).result()
    finally:
        pending.abort()
        assert not os.path.exists(temp)


def _entry_files(tier: DiskTier) -> list[Path]:
    return sorted(p for p in tier.objects.rglob("*.safetensors"))


def test_an_entry_is_synced_renamed_and_its_directory_synced_before_it_is_published(
    tier: DiskTier, recorder: Recorder
) -> None:
    data = body((300,), "U8", 1, seed=1)
    journal = tier.root / "upload-queue"
    staged = _stage(journal, "rec.json", b"{}")
    assert _submit(tier, "a", data, (staged,)) is True
    [final] = _entry_files(tier)
    [(_, temp, _)] = [e for e in recorder.events if e[0] == "rename" and e[2] == str(final)]
    record = (
        recorder.index("fdatasync", str(staged.path)),
        recorder.index("rename", str(staged.path), str(staged.final)),
        recorder.index("fsync", str(journal)),
    )
    entry = (
        recorder.index("fdatasync", temp),
        recorder.index("rename", temp, str(final)),
        recorder.index("fsync", str(final.parent)),
        recorder.index("publish", "a"),
    )
    assert list(record) == sorted(record), recorder.events
    assert list(entry) == sorted(entry), recorder.events
    assert record[-1] < entry[1], "the journal record must be durable before the entry's name"


@pytest.mark.parametrize("failing", ["entry", "journal"])
def test_a_failing_directory_sync_leaves_nothing_visible(
    tier: DiskTier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    data = body((300,), "U8", 1, seed=2)
    journal = tier.root / "upload-queue"
    real = file_sync.fsync_dir

    def fsync_dir(path: Path) -> None:
        target = journal if failing == "journal" else tier.objects
        if path == target or (path.parent == target and failing == "entry"):
            raise OSError(errno.EIO, "injected directory sync failure", str(path))
        real(path)

    monkeypatch.setattr(group_commit, "fsync_dir", fsync_dir)
    with pytest.raises(OSError, match="injected"):
        _submit(tier, "b", data, (_stage(journal, "rec.json", b"{}"),))
    assert not tier.contains(_key("b"))
    assert tier.open(_key("b")) is None
    assert _entry_files(tier) == []
    assert list(tier.tmp.iterdir()) == []
    tier.close()
    again = DiskTier(tier.root, max_bytes=10_000_000)
    again.rebuild()
    try:
        assert not again.contains(_key("b"))
    finally:
        again.close()


def test_write_durably_syncs_the_file_before_the_rename_and_the_directory_after(
    tmp_path: Path, recorder: Recorder
) -> None:
    path = tmp_path / "journal.json"
    write_durably(path, b"one")
    [(_, temp, _)] = [e for e in recorder.events if e[0] == "rename"]
    order = (
        recorder.index("fsync", temp),
        recorder.index("rename", temp, str(path)),
        recorder.index("fsync", str(tmp_path)),
    )
    assert list(order) == sorted(order), recorder.events
    assert path.read_bytes() == b"one"
    assert sorted(tmp_path.iterdir()) == [path]


def test_write_durably_leaves_the_old_file_when_the_sync_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "journal.json"
    write_durably(path, b"old")

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "injected file sync failure")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="injected"):
        write_durably(path, b"new")
    assert path.read_bytes() == b"old"
    assert sorted(tmp_path.iterdir()) == [path]


def _durable_write_of(recorder: Recorder, final: Path) -> None:
    """``final`` was written as ``write_durably`` writes: synced, renamed, dir synced."""
    renames = [e for e in recorder.events if e[0] == "rename" and e[2] == str(final)]
    assert renames, f"{final} was never renamed into place: {recorder.events}"
    temp = renames[-1][1]
    order = (
        recorder.index("fsync", temp),
        recorder.index("rename", temp, str(final)),
        recorder.index("fsync", str(final.parent)),
    )
    assert list(order) == sorted(order), recorder.events


def test_a_delete_record_of_the_upload_journal_is_durable(
    tier: DiskTier, recorder: Recorder
) -> None:
    journal = UploadJournal(tier.root)
    item = PendingUpload(_key("gone"), 0, 0, 0.0, upload=False, deleted=True)
    journal.write(item)
    final = journal.path(item.key)
    _durable_write_of(recorder, final)
    assert json.loads(final.read_text())["deleted"] is True


@pytest.mark.anyio
async def test_a_purge_record_is_durable_before_the_purge_is_reported(
    tier: DiskTier, recorder: Recorder
) -> None:
    purges = Purges(tier.root, tier, None, None, DiskOnlyPolicy())
    job, started = await purges.request("m", None)
    assert started
    _durable_write_of(recorder, purges.directory / f"{job.id}.json")
    await purges.stop()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
