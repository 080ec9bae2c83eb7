"""The write-back scheduler on its journal: pinning, backoff, drops (no S3 needed)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from app.checksum import crc32c
from app.keys import EntryKey
from app.safetensors_format import validate_body
from app.tiers.disk import DiskTier
from app.tiers.upload_journal import PendingUpload, UploadJournal
from app.tiers.upload_scheduler import EntryGone, UploadScheduler
from testkit.entries import body

pytestmark = pytest.mark.anyio

KEY = EntryKey("org/model", "float32", "abc")


class FakeS3:
    def __init__(self, failures: int = 0, delete_failures: int = 0) -> None:
        self.failures = failures
        self.delete_failures = delete_failures
        self.uploaded: list[EntryKey] = []
        self.deleted: list[EntryKey] = []
        self.calls = 0

    async def upload(self, item: PendingUpload) -> bool:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("S3 down")
        self.uploaded.append(item.key)
        return True

    async def delete(self, key: EntryKey) -> None:
        if self.delete_failures > 0:
            self.delete_failures -= 1
            raise ConnectionError("S3 down")
        self.deleted.append(key)


def make_queue(
    root: Path,
    disk: DiskTier,
    s3: FakeS3,
    *,
    upload: Callable[[PendingUpload], Awaitable[bool]] | None = None,
    delete: Callable[[EntryKey], Awaitable[None]] | None = None,
    **kw: int | float,
) -> UploadScheduler:
    """A queue on ``s3``'s upload and delete (or those given), small bounds and retries."""
    options: dict[str, int | float] = {
        "max_entries": 10,
        "max_bytes": 10 << 20,
        "workers": 2,
        "retry_min": 0.05,
        "retry_max": 0.2,
    }
    options.update(kw)
    return UploadScheduler(
        UploadJournal(root),
        disk,
        upload or s3.upload,
        delete or s3.delete,
        registry=CollectorRegistry(),
        **options,  # type: ignore[arg-type]
    )


def commit(disk: DiskTier, key: EntryKey, data: bytes) -> None:
    pending = disk.begin_write(key)
    pending.write([data])
    assert pending.commit(crc32c(data), validate_body(data, key.dtype))


def put_pending(queue: UploadScheduler, disk: DiskTier, key: EntryKey, data: bytes) -> None:
    item = queue.reserve(key, len(data), 0)
    queue.journal.write(item)
    commit(disk, key, data)
    queue.release(item, created=True)


@pytest.fixture
def disk(tmp_path: Path) -> DiskTier:
    tier = DiskTier(tmp_path, 1 << 20)
    tier.rebuild()
    return tier


async def test_journal_survives_restart_and_pins(tmp_path: Path, disk: DiskTier) -> None:
    s3 = FakeS3()
    queue = make_queue(tmp_path, disk, s3)
    data = body((8, 8))
    put_pending(queue, disk, KEY, data)  # workers not started: stays pending
    record = json.loads((tmp_path / "upload-queue" / f"{KEY.digest}.json").read_text())
    assert (record["model"], record["dtype"], record["hash"]) == ("org/model", "float32", "abc")

    # "Restart": a new disk tier and queue over the same directory.
    disk2 = DiskTier(tmp_path, 1 << 20)
    queue2 = make_queue(tmp_path, disk2, s3)
    assert queue2.load() == 1
    disk2.rebuild()
    assert queue2.reconcile() == 1
    assert disk2.stats().pinned == 1
    await queue2.start()
    try:
        assert await queue2.wait_idle(5)
    finally:
        await queue2.stop()
    assert s3.uploaded == [KEY]
    assert disk2.stats().pinned == 0
    assert list((tmp_path / "upload-queue").iterdir()) == []


async def test_records_without_disk_entry_are_dropped(tmp_path: Path, disk: DiskTier) -> None:
    queue = make_queue(tmp_path, disk, FakeS3())
    item = queue.reserve(KEY, 10, 0)
    queue.journal.write(item)  # crash before the disk commit
    (tmp_path / "upload-queue" / ".stray.tmp").write_text("x")
    (tmp_path / "upload-queue" / "garbage.json").write_text("{not json")
    queue2 = make_queue(tmp_path, DiskTier(tmp_path, 1 << 20), FakeS3())
    assert queue2.load() == 1
    assert queue2.reconcile() == 0
    assert list((tmp_path / "upload-queue").iterdir()) == []


async def test_failures_back_off_then_succeed(tmp_path: Path, disk: DiskTier) -> None:
    s3 = FakeS3(failures=3)
    queue = make_queue(tmp_path, disk, s3)
    await queue.start()
    try:
        put_pending(queue, disk, KEY, body((4, 4)))
        assert await queue.wait_idle(10)
    finally:
        await queue.stop()
    assert s3.calls == 4 and s3.uploaded == [KEY]
    registry = queue.metrics.registry
    assert registry.get_sample_value("ec_s3_uploads_total", {"outcome": "retry"}) == 3


async def test_entry_gone_is_dropped_not_retried(tmp_path: Path, disk: DiskTier) -> None:
    calls = 0

    async def upload(item: PendingUpload) -> bool:
        nonlocal calls
        calls += 1
        raise EntryGone("deleted")

    queue = make_queue(
        tmp_path, disk, FakeS3(), upload=upload, max_bytes=1 << 20, workers=1, retry_max=0.1
    )
    await queue.start()
    try:
        put_pending(queue, disk, KEY, body((4, 4)))
        assert await queue.wait_idle(5)
        await asyncio.sleep(0.2)  # twice retry_max: a retry would have come by now
    finally:
        await queue.stop()
    assert calls == 1 and disk.stats().pinned == 0


async def test_bounds_and_a_delete_with_nothing_pending(tmp_path: Path, disk: DiskTier) -> None:
    s3 = FakeS3()
    queue = make_queue(tmp_path, disk, s3, max_entries=1, max_bytes=1000)
    assert queue.has_room(1000) and not queue.has_room(1001)
    item = queue.reserve(KEY, 100, 0)
    assert not queue.has_room(1)  # one entry at most
    queue.journal.write(item)
    queue.release(item, created=False)  # the PUT failed: nothing owed
    assert len(queue) == 0 and queue.pending_bytes == 0 and disk.stats().pinned == 0
    assert list((tmp_path / "upload-queue").iterdir()) == []

    # A DELETE of a key with no pending upload still owes the S3 delete, journaled.
    item = await queue.mark_deleted(KEY)
    record = json.loads((tmp_path / "upload-queue" / f"{KEY.digest}.json").read_text())
    assert (record["deleted"], record["upload"]) == (True, False)
    assert queue.hides(KEY) and queue.deletes_pending == 1
    await queue.delete_now(item)
    assert s3.deleted == [KEY] and not queue.hides(KEY)
    assert len(queue) == 0 and disk.stats().pinned == 0
    assert list((tmp_path / "upload-queue").iterdir()) == []


def blocking_upload(
    started: asyncio.Event, finish: asyncio.Event, outcome: list[BaseException | None]
) -> Callable[[PendingUpload], Awaitable[bool]]:
    """An upload that starts, waits for ``finish``, then raises ``outcome[0]`` (if any)."""

    async def upload(item: PendingUpload) -> bool:
        started.set()
        await finish.wait()
        if outcome[0] is not None:
            raise outcome[0]
        return True

    return upload


@pytest.mark.parametrize("upload_fails", [False, True])
async def test_a_delete_during_an_upload_is_sent_after_it_until_s3_confirms(
    tmp_path: Path, disk: DiskTier, upload_fails: bool
) -> None:
    """A DELETE while the upload is in flight: journaled at once (a restart keeps it),
    the object hidden; once the upload is over (stored, or failed: its outcome unknown)
    the delete is sent, retried past a failure, and only then is the record gone."""
    started, finish = asyncio.Event(), asyncio.Event()
    outcome: list[BaseException | None] = [ConnectionError("timed out") if upload_fails else None]
    s3 = FakeS3(delete_failures=1)
    queue = make_queue(
        tmp_path,
        disk,
        s3,
        upload=blocking_upload(started, finish, outcome),
        max_bytes=1 << 20,
        workers=1,
        retry_min=0.01,
        retry_max=0.01,
    )
    await queue.start()
    try:
        put_pending(queue, disk, KEY, body((4, 4)))
        await asyncio.wait_for(started.wait(), 5)
        item = await queue.mark_deleted(KEY)
        assert queue.hides(KEY)
        await queue.delete_now(item)  # the upload is in flight: not now
        assert s3.deleted == []
        record = json.loads((tmp_path / "upload-queue" / f"{KEY.digest}.json").read_text())
        assert (record["deleted"], record["upload"]) == (True, False)

        restarted = make_queue(tmp_path, DiskTier(tmp_path, 1 << 20), FakeS3())
        assert restarted.load() == 1 and restarted.hides(KEY)

        finish.set()
        assert await queue.wait_idle(5)
    finally:
        await queue.stop()
    assert s3.deleted == [KEY]  # once, after the failed first try
    registry = queue.metrics.registry
    assert registry.get_sample_value("ec_s3_upload_queue_deletes_total", {"outcome": "retry"}) == 1
    assert not queue.hides(KEY) and disk.stats().pinned == 0
    assert list((tmp_path / "upload-queue").iterdir()) == []


async def test_a_put_after_a_delete_is_uploaded_after_the_delete(
    tmp_path: Path, disk: DiskTier
) -> None:
    """The key owes a delete that fails (S3 down); a new PUT of it is journaled with
    both, and at restart the delete goes first, then the new entry's upload."""
    s3 = FakeS3(delete_failures=100)
    queue = make_queue(tmp_path, disk, s3)
    item = await queue.mark_deleted(KEY)
    await queue.delete_now(item)
    assert queue.hides(KEY) and s3.deleted == []
    put_pending(queue, disk, KEY, body((4, 4), seed=9))
    record = json.loads((tmp_path / "upload-queue" / f"{KEY.digest}.json").read_text())
    assert (record["deleted"], record["upload"]) == (True, True)

    order: list[str] = []

    async def upload(pending: PendingUpload) -> bool:
        order.append("upload")
        return True

    async def delete(key: EntryKey) -> None:
        order.append("delete")

    disk2 = DiskTier(tmp_path, 1 << 20)
    queue2 = make_queue(
        tmp_path,
        disk2,
        FakeS3(),
        upload=upload,
        delete=delete,
        max_bytes=1 << 20,
        retry_min=0.01,
        retry_max=0.01,
    )
    assert queue2.load() == 1
    disk2.rebuild()
    assert queue2.reconcile() == 1
    await queue2.start()
    try:
        assert await queue2.wait_idle(5)
    finally:
        await queue2.stop()
    assert order == ["delete", "upload"]
    assert disk2.contains(KEY)


async def test_a_delete_interrupted_by_a_crash_is_finished_at_start_up(
    tmp_path: Path, disk: DiskTier
) -> None:
    """Journaled, then the process died before the disk entry went: start-up removes
    the entry, and the S3 delete is sent."""
    queue = make_queue(tmp_path, disk, FakeS3())
    put_pending(queue, disk, KEY, body((4, 4)))
    await queue.mark_deleted(KEY)  # and nothing more: the crash
    s3 = FakeS3()
    disk2 = DiskTier(tmp_path, 1 << 20)
    queue2 = make_queue(tmp_path, disk2, s3)
    assert queue2.load() == 1
    disk2.rebuild()
    assert disk2.contains(KEY)
    assert queue2.reconcile() == 1
    assert not disk2.contains(KEY) and queue2.hides(KEY)
    await queue2.start()
    try:
        assert await queue2.wait_idle(5)
    finally:
        await queue2.stop()
    assert s3.deleted == [KEY] and s3.uploaded == []


async def test_concurrent_puts_of_one_key_share_the_record(tmp_path: Path, disk: DiskTier) -> None:
    queue = make_queue(tmp_path, disk, FakeS3())
    first = queue.reserve(KEY, 100, 0)
    second = queue.reserve(KEY, 100, 0)
    assert first is second and len(queue) == 1 and queue.pending_bytes == 100
    # The second PUT commits first; the first then finds the key taken. The record
    # must survive both, because the committed entry still needs its upload.
    commit(disk, KEY, body((4, 4)))
    queue.release(second, created=True)
    queue.release(first, created=True)
    assert len(queue) == 1 and first.next_attempt == 0.0

    # Two PUTs that both fail: the record goes with the last of them.
    other = EntryKey("org/model", "float32", "other")
    a = queue.reserve(other, 50, 0)
    b = queue.reserve(other, 50, 0)
    queue.release(a, created=False)
    assert len(queue) == 2
    queue.release(b, created=False)
    assert len(queue) == 1 and disk.stats().pinned == 1


def test_s3_endpoint_without_bucket_stops_start_up(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "EC_S3_ENDPOINT_URL": "http://127.0.0.1:9",
        "EC_DATA_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "app"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "EC_S3_BUCKET must be set" in proc.stderr
