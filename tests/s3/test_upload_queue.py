"""The write-back queue on its own: journal, pinning, backoff, drops (no S3 needed)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from app.checksum import crc32c
from app.keys import EntryKey
from app.safetensors_format import validate_body
from app.tiers.disk import DiskTier
from app.tiers.upload_queue import EntryGone, PendingUpload, UploadQueue
from tests.support.entries import body

pytestmark = pytest.mark.anyio

KEY = EntryKey("org/model", "float32", "abc")


class FakeS3:
    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.uploaded: list[EntryKey] = []
        self.deleted: list[EntryKey] = []
        self.calls = 0

    async def upload(self, item: PendingUpload) -> None:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("S3 down")
        self.uploaded.append(item.key)

    async def delete(self, key: EntryKey) -> None:
        self.deleted.append(key)


def make_queue(root: Path, disk: DiskTier, s3: FakeS3, **kw: int | float) -> UploadQueue:
    options: dict[str, int | float] = {
        "max_entries": 10,
        "max_bytes": 10 << 20,
        "workers": 2,
        "retry_min": 0.05,
        "retry_max": 0.2,
    }
    options.update(kw)
    return UploadQueue(
        root,
        disk,
        s3.upload,
        s3.delete,
        registry=CollectorRegistry(),
        **options,  # type: ignore[arg-type]
    )


def commit(disk: DiskTier, key: EntryKey, data: bytes) -> None:
    pending = disk.begin_write(key)
    pending.write([data])
    assert pending.commit(crc32c(data), validate_body(data, key.dtype))


def put_pending(queue: UploadQueue, disk: DiskTier, key: EntryKey, data: bytes) -> None:
    item = queue.reserve(key, len(data), 0)
    queue.write_record(item)
    commit(disk, key, data)
    queue.release(item, on_disk=True)


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
    queue.write_record(item)  # crash before the disk commit
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

    async def upload(item: PendingUpload) -> None:
        nonlocal calls
        calls += 1
        raise EntryGone("deleted")

    queue = UploadQueue(
        tmp_path,
        disk,
        upload,
        FakeS3().delete,
        max_entries=10,
        max_bytes=1 << 20,
        workers=1,
        retry_min=0.05,
        retry_max=0.1,
        registry=CollectorRegistry(),
    )
    await queue.start()
    try:
        put_pending(queue, disk, KEY, body((4, 4)))
        assert await queue.wait_idle(5)
        await asyncio.sleep(0.2)
    finally:
        await queue.stop()
    assert calls == 1 and disk.stats().pinned == 0


async def test_bounds_and_discard(tmp_path: Path, disk: DiskTier) -> None:
    queue = make_queue(tmp_path, disk, FakeS3(), max_entries=1, max_bytes=1000)
    assert queue.has_room(1000) and not queue.has_room(1001)
    item = queue.reserve(KEY, 100, 0)
    assert not queue.has_room(1)  # one entry at most
    queue.write_record(item)
    assert queue.discard(KEY) is False
    assert len(queue) == 0 and queue.pending_bytes == 0 and disk.stats().pinned == 0
    assert list((tmp_path / "upload-queue").iterdir()) == []


async def test_discard_during_a_failing_upload_is_not_retried(
    tmp_path: Path, disk: DiskTier
) -> None:
    started, fail = asyncio.Event(), asyncio.Event()
    calls = 0

    async def upload(item: PendingUpload) -> None:
        nonlocal calls
        calls += 1
        started.set()
        await fail.wait()
        raise ConnectionError("S3 down")

    s3 = FakeS3()
    queue = UploadQueue(
        tmp_path,
        disk,
        upload,
        s3.delete,
        max_entries=10,
        max_bytes=1 << 20,
        workers=1,
        retry_min=0.01,
        retry_max=0.01,
        registry=CollectorRegistry(),
    )
    await queue.start()
    try:
        put_pending(queue, disk, KEY, body((4, 4)))
        await asyncio.wait_for(started.wait(), 5)
        assert queue.discard(KEY) is True  # the upload is running: it is told, not cut
        fail.set()
        assert await queue.wait_idle(5)  # the failed attempt forgets it: no retry
        await asyncio.sleep(0.1)
    finally:
        await queue.stop()
    assert calls == 1 and s3.deleted == []
    assert disk.stats().pinned == 0
    assert list((tmp_path / "upload-queue").iterdir()) == []


async def test_concurrent_puts_of_one_key_share_the_record(tmp_path: Path, disk: DiskTier) -> None:
    queue = make_queue(tmp_path, disk, FakeS3())
    first = queue.reserve(KEY, 100, 0)
    second = queue.reserve(KEY, 100, 0)
    assert first is second and len(queue) == 1 and queue.pending_bytes == 100
    # The second PUT commits first; the first then finds the key taken. The record
    # must survive both, because the committed entry still needs its upload.
    commit(disk, KEY, body((4, 4)))
    queue.release(second, on_disk=True)
    queue.release(first, on_disk=True)
    assert len(queue) == 1 and first.next_attempt == 0.0

    # Two PUTs that both fail: the record goes with the last of them.
    other = EntryKey("org/model", "float32", "other")
    a = queue.reserve(other, 50, 0)
    b = queue.reserve(other, 50, 0)
    queue.release(a, on_disk=False)
    assert len(queue) == 2
    queue.release(b, on_disk=False)
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
