from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from app.checksum import crc32c
from app.errors import InsufficientStorage, Unavailable
from app.keys import EntryKey
from app.safetensors_format import validate_body
from app.tiers.disk import DiskTier, PendingWrite
from app.tiers.disk import pending as pending_module
from testkit.entries import body


def _key(name: str) -> EntryKey:
    return EntryKey.parse("model/x", "uint8", name)


def _put(tier: DiskTier, name: str, data: bytes) -> bool:
    key = _key(name)
    pending = tier.begin_write(key, len(data))
    try:
        pending.write([data[: len(data) // 2], data[len(data) // 2 :]])
        return pending.commit(crc32c(data), validate_body(data, "uint8"))
    finally:
        pending.abort()


def _read(tier: DiskTier, name: str) -> bytes | None:
    opened = tier.open(_key(name))
    if opened is not None and not opened.verified:
        opened = tier.verify(opened)
    return None if opened is None else bytes(opened.view)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.fixture
def tier(tmp_path: Path) -> DiskTier:
    disk = DiskTier(tmp_path, max_bytes=10_000)
    disk.rebuild()
    return disk


def test_round_trip_and_first_writer_wins(tier: DiskTier) -> None:
    first, second = body((100,), "U8", 1, seed=1), body((100,), "U8", 1, seed=2)
    assert _put(tier, "a", first) is True
    assert _put(tier, "a", second) is False
    assert _read(tier, "a") == first
    assert len(_files(tier.root / "objects")) == 1
    assert _files(tier.root / "tmp") == []


def test_lru_eviction_keeps_recently_used(tier: DiskTier) -> None:
    entries = {name: body((2000,), "U8", 1, seed=i) for i, name in enumerate("abcd")}
    for name in "abcd":
        _put(tier, name, entries[name])
    assert _read(tier, "a") == entries["a"]  # a is now most recently used
    _put(tier, "e", body((2000,), "U8", 1, seed=9))  # 5 x ~2.1 KB > 10 KB: evict one
    assert _read(tier, "b") is None
    assert _read(tier, "a") == entries["a"]
    stats = tier.stats()
    assert stats.evictions == 1
    assert stats.used_bytes <= stats.max_bytes
    assert stats.used_bytes == sum(p.stat().st_size for p in _files(tier.root / "objects"))


def test_pinned_entries_are_not_evicted(tier: DiskTier) -> None:
    _put(tier, "pinned", body((4000,), "U8", 1))
    tier.pin(_key("pinned"))
    _put(tier, "b", body((4000,), "U8", 1, seed=1))
    _put(tier, "c", body((4000,), "U8", 1, seed=2))
    assert tier.contains(_key("pinned"))
    assert not tier.contains(_key("b"))
    tier.unpin(_key("pinned"))
    _put(tier, "d", body((4000,), "U8", 1, seed=3))
    assert not tier.contains(_key("pinned"))


def test_entry_larger_than_the_tier_is_refused(tier: DiskTier) -> None:
    with pytest.raises(InsufficientStorage):
        tier.begin_write(_key("big"), 20_000)
    with pytest.raises(InsufficientStorage):
        _put(tier, "big", body((20_000,), "U8", 1))
    assert _files(tier.root / "tmp") == []
    assert tier.stats().entries == 0


def test_abort_leaves_nothing(tier: DiskTier) -> None:
    pending = tier.begin_write(_key("a"))
    pending.write([b"partial"])
    pending.abort()
    assert _files(tier.root) == []
    assert not tier.contains(_key("a"))


def test_rebuild_restores_index_and_removes_strays(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 10_000)
    first.rebuild()
    data = body((500,), "U8", 1)
    _put(first, "kept", data)
    (tmp_path / "tmp" / "put-crashed.part").write_bytes(b"half a body")
    (tmp_path / "objects" / "zz").mkdir()
    (tmp_path / "objects" / "zz" / "garbage").write_bytes(b"x")

    second = DiskTier(tmp_path, 10_000)
    second.rebuild()
    assert _read(second, "kept") == data
    assert second.stats().used_bytes == len(data)
    assert _files(tmp_path / "tmp") == []
    assert not (tmp_path / "objects" / "zz" / "garbage").exists()


def test_rebuild_with_a_smaller_bound_evicts(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 10_000)
    first.rebuild()
    for i in range(4):
        _put(first, str(i), body((2000,), "U8", 1, seed=i))
    second = DiskTier(tmp_path, 5_000)
    second.rebuild()
    assert second.stats().used_bytes <= 5_000
    assert len(_files(tmp_path / "objects")) == second.stats().entries == 2


def test_corrupted_file_is_a_miss_and_removed(tier: DiskTier) -> None:
    data = body((500,), "U8", 1)
    _put(tier, "a", data)
    (path,) = _files(tier.root / "objects")
    with path.open("r+b") as f:  # flip one data byte in place
        f.seek(len(data) - 1)
        f.write(bytes([data[-1] ^ 0xFF]))
    assert _read(tier, "a") is None
    assert not path.exists()
    assert tier.stats().corrupt_removed == 1


def test_truncated_file_is_a_miss(tier: DiskTier) -> None:
    _put(tier, "a", body((500,), "U8", 1))
    (path,) = _files(tier.root / "objects")
    os.truncate(path, 0)
    assert _read(tier, "a") is None
    assert tier.stats().entries == 0


def test_reader_keeps_its_bytes_when_the_entry_is_deleted(tier: DiskTier) -> None:
    data = body((500,), "U8", 1)
    _put(tier, "a", data)
    opened = tier.open(_key("a"))
    assert opened is not None
    assert tier.delete(_key("a")) is True
    assert bytes(opened.view) == data
    assert tier.open(_key("a")) is None


def test_concurrent_writers_readers_and_deleters(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 200_000)
    tier.rebuild()
    bodies = {f"k{i}": body((1000 + i,), "U8", 1, seed=i) for i in range(20)}
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for step in range(60):
                name = f"k{(seed + step) % 20}"
                action = (seed * 7 + step) % 4
                if action == 0:
                    tier.delete(_key(name))
                elif action == 1:
                    _put(tier, name, bodies[name])
                else:
                    got = _read(tier, name)
                    assert got is None or got == bodies[name]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    on_disk = _files(tmp_path / "objects")
    stats = tier.stats()
    assert stats.entries == len(on_disk)
    assert stats.used_bytes == sum(p.stat().st_size for p in on_disk)
    assert _files(tmp_path / "tmp") == []


class _FakeFs:
    """A file system of ``free`` bytes as ``statvfs`` reports it (4 KiB blocks)."""

    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self, path: Path) -> os.statvfs_result:
        blocks = self.free // 4096
        return os.statvfs_result((4096, 4096, blocks, blocks, blocks, 0, 0, 0, 0, 255))


def test_a_body_that_cannot_fit_is_refused_before_anything_is_evicted(tmp_path: Path) -> None:
    fs = _FakeFs(free=40_960)
    tier = DiskTier(tmp_path, max_bytes=10**9, statvfs=fs)
    tier.rebuild()
    entries = {name: body((20_000,), "U8", 1, seed=i) for i, name in enumerate("abc")}
    for name, data in entries.items():
        assert _put(tier, name, data)
    # 40 KiB free + 60 KB evictable: 120 KB can never fit, whatever is evicted.
    with pytest.raises(InsufficientStorage, match="eviction could free"):
        tier.begin_write(_key("big"), 120_000)
    tier.pin(_key("a"))  # pinned entries (write-back) do not count as evictable
    with pytest.raises(InsufficientStorage):
        tier.begin_write(_key("big"), 85_000)
    assert {name: _read(tier, name) for name in entries} == entries
    assert tier.stats().evictions == 0
    assert _files(tier.root / "tmp") == []


def test_in_flight_uploads_reserve_their_space(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, max_bytes=10**9, statvfs=_FakeFs(free=100_000))
    tier.rebuild()
    first = tier.begin_write(_key("first"), 70_000)
    with pytest.raises(Unavailable):  # fits alone, not beside the first
        tier.begin_write(_key("second"), 70_000)
    first.write([b"x" * 50_000])  # written bytes leave the reservation
    assert first.remaining == 20_000
    first.abort()  # the reservation goes with the upload
    tier.begin_write(_key("second"), 70_000).abort()
    assert _files(tier.root / "tmp") == []


def test_a_reservation_holds_space_before_its_file_exists(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, max_bytes=10**9, statvfs=_FakeFs(free=100_000))
    tier.rebuild()
    reserved = tier.reserve_write(_key("first"), 70_000)
    assert _files(tier.root / "tmp") == []  # no file yet: reserve_write does no file work
    with pytest.raises(Unavailable):
        tier.reserve_write(_key("second"), 70_000)
    reserved.abort()  # never created: nothing to remove, the space is free again
    assert tier.stats().writes_in_flight == 0
    second = tier.reserve_write(_key("second"), 70_000)
    second.create()
    data = body((1_000,), "U8", 1)
    second.write([data])
    assert len(_files(tier.root / "tmp")) == 1
    assert second.commit(crc32c(data), validate_body(data, "uint8")) is True
    assert _read(tier, "second") == data
    assert _files(tier.root / "tmp") == []


# -- group commit ---------------------------------------------------------------------


def _begin(tier: DiskTier, name: str, data: bytes) -> PendingWrite:
    pending = tier.begin_write(_key(name), len(data))
    pending.write([data])
    return pending


def test_a_batch_of_more_pieces_than_iov_max_is_written_whole(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body received in small pieces hands thousands to one write: they go out
    IOV_MAX at a time (more: EINVAL), short writes resumed. Pieces of 1 MiB go out in
    one writev."""
    iov_max = os.sysconf("SC_IOV_MAX")
    calls: list[int] = []
    real = os.writev
    short = True

    def counting(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        return real(fd, buffers[:3] if short and len(buffers) > 3 else buffers)

    monkeypatch.setattr(os, "writev", counting)
    data = body((9000,), "U8", 1, seed=3)
    pieces = [data[i : i + 3] for i in range(0, len(data), 3)]
    assert len(pieces) > 2 * iov_max
    pending = tier.begin_write(_key("pieces"), len(data))
    pending.write(pieces)
    assert max(calls) <= iov_max
    assert pending.commit(crc32c(data), validate_body(data, "uint8")) is True
    assert _read(tier, "pieces") == data

    calls.clear()
    short = False
    big = DiskTier(tier.root / "big", max_bytes=10 * 1024 * 1024)
    big.rebuild()
    pending = big.begin_write(_key("big"))
    pending.write([bytes(1024 * 1024)] * 4)
    assert calls == [4] and pending.written == 4 * 1024 * 1024
    pending.abort()
    big.close()


def test_group_commit_one_batch_for_uploads_in_flight(tmp_path: Path) -> None:
    """With a commit delay, the committer waits for the temp files still being written:
    uploads finishing together share one batch (one fsync per directory)."""
    tier = DiskTier(tmp_path, max_bytes=100_000, commit_delay=30)
    tier.rebuild()
    bodies = {f"k{i}": body((500,), "U8", 1, seed=i) for i in range(6)}
    pendings = {name: _begin(tier, name, data) for name, data in bodies.items()}
    futures = [
        pendings[name].submit(crc32c(data), validate_body(data, "uint8"))
        for name, data in bodies.items()
    ]
    assert [f.result(timeout=20) for f in futures] == [True] * 6
    stats = tier.stats()
    assert (stats.commit_batches, stats.committed_entries, stats.writes_in_flight) == (1, 6, 0)
    for name, data in bodies.items():
        assert _read(tier, name) == data
    assert _files(tier.root / "tmp") == []
    tier.close()


def test_group_commit_first_writer_wins_within_a_batch(tmp_path: Path) -> None:
    """The loser of a same-batch race is answered only once the winner's entry is
    published: whoever is told "already stored" can read it at once."""
    tier = DiskTier(tmp_path, max_bytes=100_000, commit_delay=30)
    tier.rebuild()
    first, second = body((100,), "U8", 1, seed=1), body((100,), "U8", 1, seed=2)
    a, b = _begin(tier, "same", first), _begin(tier, "same", second)
    holder = tier.begin_write(_key("other"))  # the batch waits while it is in flight
    readable_when_answered: list[bytes | None] = []
    answered = threading.Event()

    def on_answer(_: object) -> None:
        readable_when_answered.append(_read(tier, "same"))
        answered.set()

    fa = a.submit(crc32c(first), validate_body(first, "uint8"))
    fb = b.submit(crc32c(second), validate_body(second, "uint8"))
    fb.add_done_callback(on_answer)
    holder.abort()
    assert (fa.result(timeout=20), fb.result(timeout=20)) == (True, False)
    assert answered.wait(20)
    assert readable_when_answered == [first]
    assert _read(tier, "same") == first
    assert len(_files(tier.root / "objects")) == 1
    assert _files(tier.root / "tmp") == []
    tier.close()


def _fail_fdatasync_of(monkeypatch: pytest.MonkeyPatch, bad_fd: int) -> None:
    """``os.fdatasync`` fails with EIO for ``bad_fd`` and works for every other one."""
    real = os.fdatasync

    def failing(fd: int) -> None:
        if fd == bad_fd:
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", failing)


def test_group_commit_loser_takes_over_when_the_winner_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the first upload of a key fails in its batch, the next one of that batch is
    not told of an entry that never existed: it is committed in its place."""
    tier = DiskTier(tmp_path, max_bytes=100_000, commit_delay=30)
    tier.rebuild()
    first, second, third = (body((100,), "U8", 1, seed=i) for i in (1, 2, 3))
    a, b, c = (_begin(tier, "same", data) for data in (first, second, third))
    _fail_fdatasync_of(monkeypatch, a.fd)
    fa, fb, fc = (
        pending.submit(crc32c(data), validate_body(data, "uint8"))
        for pending, data in ((a, first), (b, second), (c, third))
    )
    with pytest.raises(OSError, match="Input/output error"):
        fa.result(timeout=20)
    assert (fb.result(timeout=20), fc.result(timeout=20)) == (True, False)
    assert _read(tier, "same") == second
    assert len(_files(tier.root / "objects")) == 1
    assert _files(tier.root / "tmp") == []
    stats = tier.stats()
    assert (stats.commit_batches, stats.committed_entries) == (2, 1)  # two rounds
    tier.close()


def test_group_commit_failure_fails_only_its_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fdatasync error in the middle of a batch: that upload gets the error and leaves
    nothing behind; the others of the batch are published."""
    tier = DiskTier(tmp_path, max_bytes=100_000, commit_delay=30)
    tier.rebuild()
    bodies = {f"k{i}": body((300,), "U8", 1, seed=i) for i in range(3)}
    pendings = {name: _begin(tier, name, data) for name, data in bodies.items()}
    _fail_fdatasync_of(monkeypatch, pendings["k1"].fd)
    futures = {
        name: pendings[name].submit(crc32c(data), validate_body(data, "uint8"))
        for name, data in bodies.items()
    }
    assert futures["k0"].result(timeout=20) is True
    assert futures["k2"].result(timeout=20) is True
    with pytest.raises(OSError, match="Input/output error"):
        futures["k1"].result(timeout=20)
    assert not tier.contains(_key("k1"))
    assert _read(tier, "k0") == bodies["k0"] and _read(tier, "k2") == bodies["k2"]
    assert _files(tier.root / "tmp") == []
    assert len(_files(tier.root / "objects")) == 2
    tier.close()


def test_group_commit_syncs_what_was_not_synced_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload whose early fdatasync was not started (its key existed when it was
    handed over, or the tier is closing) is synced by its batch before it is published."""
    tier = DiskTier(tmp_path, max_bytes=100_000)
    tier.rebuild()
    first, second = body((100,), "U8", 1, seed=1), body((100,), "U8", 1, seed=2)
    assert _put(tier, "k", first) is True
    late = _begin(tier, "k", second)
    tier.close()  # batches now run in the submitting thread: order is deterministic
    assert tier.delete(_key("k"))
    synced: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counting)
    late_fd = late.fd
    assert late.submit(crc32c(second), validate_body(second, "uint8")).result() is True
    assert synced == [late_fd]
    assert _read(tier, "k") == second
    assert _files(tier.root / "tmp") == []


def _write(tier: DiskTier, name: str, data: bytes, *, durable: bool) -> PendingWrite:
    pending = tier.reserve_write(_key(name), len(data), durable=durable)
    pending.create()
    pending.write([data])
    return pending


@pytest.mark.parametrize("durable", [True, False])
def test_only_durable_writes_are_synced(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    """A copy of what the backend holds (``durable=False``) is published without its
    bytes pushed early, fdatasync'ed or its directory fsync'ed; a durable one gets all
    three. The entry's shard directory exists already (a new one is synced anyway)."""
    (tier.root / "objects" / _key("k").digest[:2]).mkdir()
    calls: list[str] = []
    real_fdatasync, real_fsync = os.fdatasync, os.fsync

    def recorded(name: str, real: Callable[[int], None]) -> Callable[[int], None]:
        def call(fd: int) -> None:
            calls.append(name)
            real(fd)

        return call

    monkeypatch.setattr(os, "fdatasync", recorded("fdatasync", real_fdatasync))
    monkeypatch.setattr(os, "fsync", recorded("fsync", real_fsync))
    monkeypatch.setattr(pending_module, "start_writeback", lambda *_: calls.append("writeback"))
    data = body((500,), "U8", 1)
    pending = _write(tier, "k", data, durable=durable)
    assert pending.commit(crc32c(data), validate_body(data, "uint8")) is True
    assert calls == (["writeback", "fdatasync", "fsync"] if durable else [])
    assert _read(tier, "k") == data
    assert _files(tier.root / "tmp") == []
    tier.close()


def test_a_new_shard_directory_is_synced_for_a_copy_too(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Later entries, durable ones too, are renamed into the shard directory a copy
    created: its name in ``objects/`` is made durable all the same."""
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", lambda fd: pytest.fail("a copy was fdatasync'ed"))
    data = body((500,), "U8", 1)
    assert _write(tier, "k", data, durable=False).commit(crc32c(data), validate_body(data, "uint8"))
    assert len(synced) == 1  # objects/, for the new shard; not the shard itself
    tier.close()


def test_a_copy_torn_by_a_power_cut_is_dropped_at_its_first_read(tmp_path: Path) -> None:
    """What a power cut can leave of an unsynced copy: the renamed file with its blocks
    never written (zeros). The next start-up trusts nothing it did not check: the first
    read verifies the CRC32C in the file's name and drops the entry."""
    first = DiskTier(tmp_path, 10_000)
    first.rebuild()
    data = body((500,), "U8", 1)
    assert _write(first, "k", data, durable=False).commit(
        crc32c(data), validate_body(data, "uint8")
    )
    first.close()
    (path,) = _files(tmp_path / "objects")
    path.write_bytes(bytes(len(data)))

    second = DiskTier(tmp_path, 10_000)
    second.rebuild()
    assert second.contains(_key("k"))  # listed by name, not yet read
    assert _read(second, "k") is None
    assert not path.exists()
    assert second.stats().corrupt_removed == 1
