"""Read-through on the Backend interface alone: an in-memory backend (no S3) behind a real
disk tier. Shows the store's side needs nothing of S3; the S3 behaviour itself is tested
against SeaweedFS in tests/s3."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import pytest
from prometheus_client import CollectorRegistry

from app.checksum import crc32c
from app.errors import InsufficientStorage, InvalidBackendObject
from app.keys import EntryKey
from app.safetensors_format import TensorHeader, validate_body
from app.tiers import read_through
from app.tiers.base import Backend, RemoteInfo, RemotePut
from app.tiers.disk import DiskTier, PendingWrite
from app.tiers.read_through import ReadThrough
from testkit.entries import body
from testkit.polling import async_wait_for

pytestmark = pytest.mark.anyio

KEY = EntryKey.parse("org/model", "float32", "h1")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class MemoryBody:
    def __init__(self, backend: MemoryBackend, data: bytes, crc: int | None) -> None:
        self.backend = backend
        self.data, self.size, self.crc32c = data, len(data), crc
        self.header: TensorHeader | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        for start in range(0, self.size, 100):
            await self.backend.gate.wait()
            chunk = self.data[start : start + 100]
            self.backend.yielded += len(chunk)
            yield chunk

    async def aclose(self) -> None:
        pass

    async def __aenter__(self) -> MemoryBody:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class MemoryBackend:
    """Entries in a dict; ``opens`` counts body reads, ``yielded`` the bytes they
    yielded, ``gate`` holds them back."""

    name = "s3"

    def __init__(self) -> None:
        self.entries: dict[EntryKey, tuple[bytes, int | None]] = {}
        self.opens = 0
        self.yielded = 0
        self.gate = asyncio.Event()
        self.gate.set()
        #: Headers that stored metadata describes (``RemoteBody.header``), per entry.
        self.described: dict[EntryKey, TensorHeader] = {}

    async def head(self, key: EntryKey, *, read_header: bool = True) -> RemoteInfo | None:
        if key not in self.entries:
            return None
        data, crc = self.entries[key]
        return RemoteInfo(len(data), crc, validate_body(data, key.dtype))

    async def open(self, key: EntryKey) -> MemoryBody | None:
        if key not in self.entries:
            return None
        self.opens += 1
        data, crc = self.entries[key]
        opened = MemoryBody(self, data, crc)
        opened.header = self.described.get(key)
        return opened

    async def contains(self, key: EntryKey) -> bool:
        return key in self.entries

    async def put_file(
        self, key: EntryKey, path: str | os.PathLike[str], crc32c: int, header: TensorHeader
    ) -> bool:
        if key in self.entries:
            return False  # first writer wins, as S3's conditional write
        self.entries[key] = (Path(path).read_bytes(), crc32c)
        return True

    def begin_put(
        self, key: EntryKey, size: int, crc32c: int, header: TensorHeader
    ) -> RemotePut | None:
        return None  # every upload goes through put_file

    async def delete(self, key: EntryKey) -> None:
        self.entries.pop(key, None)

    def namespace_prefix(self, model: str, dtype: str) -> str:
        return f"{model}/{dtype}/"

    async def list_page(
        self, prefix: str, *, start_after: str | None, limit: int
    ) -> tuple[list[tuple[str, int]], str | None]:
        return [], None

    async def delete_many(self, names: Sequence[str]) -> None:
        pass

    @property
    def up(self) -> bool:
        return True

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def readiness(self) -> str:
        return "ok"

    def describe(self) -> Mapping[str, object]:
        return {}


@pytest.fixture
def writer() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2, thread_name_prefix="test-fill-write") as pool:
        yield pool


def setup(
    tmp_path: Path, writer: ThreadPoolExecutor
) -> tuple[MemoryBackend, DiskTier, ReadThrough]:
    backend = MemoryBackend()
    as_backend: Backend = backend  # the fake satisfies the interface (checked by mypy)
    disk = DiskTier(tmp_path, 1 << 20)
    disk.rebuild()
    return backend, disk, ReadThrough(as_backend, disk, writer, CollectorRegistry(), 256)


async def read(reader: ReadThrough, key: EntryKey) -> bytes:
    entry = await reader.get(key)
    assert entry is not None and entry.chunks is not None
    return b"".join([chunk async for chunk in entry.chunks])


async def test_concurrent_misses_make_one_read_and_fill_the_disk(
    tmp_path: Path, writer: ThreadPoolExecutor
) -> None:
    backend, disk, reader = setup(tmp_path, writer)
    data = body((8, 16))
    backend.entries[KEY] = (data, crc32c(data))
    backend.gate.clear()  # hold the body until every reader joined
    readers = [asyncio.create_task(read(reader, KEY)) for _ in range(5)]
    await async_wait_for(
        lambda: KEY.digest in reader._fills and reader._fills[KEY.digest]._readers == 5,
        "the five readers to join one fill",
    )
    backend.gate.set()
    assert await asyncio.gather(*readers) == [data] * 5
    assert backend.opens == 1
    await reader.settle(KEY)
    opened = disk.open(KEY)
    assert opened is not None and bytes(opened.view) == data
    assert await reader.get(EntryKey.parse("org/model", "float32", "absent")) is None


async def test_corrupt_body_is_refused_and_not_cached(
    tmp_path: Path, writer: ThreadPoolExecutor
) -> None:
    backend, disk, reader = setup(tmp_path, writer)
    data = body((8, 16))
    backend.entries[KEY] = (data, crc32c(data) ^ 1)
    with pytest.raises(InvalidBackendObject, match="not a valid entry"):
        await read(reader, KEY)
    assert not disk.contains(KEY)
    assert list((tmp_path / "tmp").iterdir()) == []


async def test_head_without_a_stored_crc_fills_once(
    tmp_path: Path, writer: ThreadPoolExecutor
) -> None:
    backend, disk, reader = setup(tmp_path, writer)
    data = body((4, 4))
    backend.entries[KEY] = (data, None)
    info = await reader.head(KEY)
    assert info is not None and (info.size, info.crc32c, info.tier) == (
        len(data),
        crc32c(data),
        "s3",
    )
    await reader.settle(KEY)
    assert backend.opens == 1 and disk.contains(KEY)


async def test_an_entry_its_metadata_describes_is_answered_before_its_body(
    tmp_path: Path, writer: ThreadPoolExecutor
) -> None:
    backend, disk, reader = setup(tmp_path, writer)
    data = body((8, 16))
    backend.entries[KEY] = (data, crc32c(data))
    backend.described[KEY] = validate_body(data, KEY.dtype)
    backend.gate.clear()  # not one body byte yet
    entry = await asyncio.wait_for(reader.get(KEY), 5)
    assert entry is not None and entry.chunks is not None
    assert entry.info.header == backend.described[KEY]
    assert (entry.info.size, entry.info.crc32c) == (len(data), crc32c(data))
    backend.gate.set()
    assert b"".join([chunk async for chunk in entry.chunks]) == data
    await reader.settle(KEY)
    assert disk.contains(KEY)


async def test_metadata_that_misdescribes_the_body_fails_the_read_and_caches_nothing(
    tmp_path: Path, writer: ThreadPoolExecutor
) -> None:
    backend, disk, reader = setup(tmp_path, writer)
    data = body((8, 16))
    backend.entries[KEY] = (data, crc32c(data))
    real = validate_body(data, KEY.dtype)
    backend.described[KEY] = TensorHeader(real.dtype, (16, 8), real.header_length)
    entry = await reader.get(KEY)  # answered from the metadata: headers are out
    assert entry is not None and entry.chunks is not None
    with pytest.raises(InvalidBackendObject, match=r"header says float32 \[8,16\].*\[16,8\]"):
        b"".join([chunk async for chunk in entry.chunks])
    await reader.settle(KEY)
    assert not disk.contains(KEY)
    assert list((tmp_path / "tmp").iterdir()) == []


async def test_an_object_the_disk_tier_cannot_hold_is_refused_before_any_answer(
    tmp_path: Path, writer: ThreadPoolExecutor
) -> None:
    """The fill reserves its space before the response headers, even when the object's
    metadata could answer at once: a 507, not a 200 cut short."""
    backend, disk, reader = setup(tmp_path, writer)
    data = body((2 << 20,), "U8", 1)  # larger than the 1 MiB tier
    key = EntryKey.parse("org/model", "uint8", "big")
    backend.entries[key] = (data, crc32c(data))
    backend.described[key] = validate_body(data, key.dtype)
    with pytest.raises(InsufficientStorage):
        await reader.get(key)
    assert not disk.contains(key) and list((tmp_path / "tmp").iterdir()) == []


@pytest.fixture
def stalled_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every fill write waits (in its writer thread) until the event is set."""
    release = threading.Event()
    write = PendingWrite.write

    def stalled(self: PendingWrite, chunks: Sequence[bytes | memoryview]) -> None:
        if not release.wait(10):
            raise TimeoutError("the test never released the disk")
        write(self, chunks)

    monkeypatch.setattr(PendingWrite, "write", stalled)
    yield release
    release.set()


async def test_readers_get_the_body_at_the_backends_pace_not_the_disks(
    tmp_path: Path, writer: ThreadPoolExecutor, stalled_disk: threading.Event
) -> None:
    backend, disk, reader = setup(tmp_path, writer)
    data = body((8, 16))
    backend.entries[KEY] = (data, crc32c(data))
    assert await asyncio.wait_for(read(reader, KEY), 5) == data  # nothing written yet
    assert not disk.contains(KEY)
    stalled_disk.set()
    await reader.settle(KEY)
    opened = disk.open(KEY)
    assert opened is not None and bytes(opened.view) == data


async def test_a_fill_stops_reading_when_the_disk_falls_too_far_behind(
    tmp_path: Path,
    writer: ThreadPoolExecutor,
    stalled_disk: threading.Event,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(read_through, "RECENT_BYTES", 1000)
    backend, disk, reader = setup(tmp_path, writer)
    data = body((64, 64))  # 16 KiB, read in 100-byte chunks
    backend.entries[KEY] = (data, crc32c(data))
    reading = asyncio.create_task(read(reader, KEY))
    # The batch in the writer thread (what waited while the file was created: just
    # over 1000 bytes) and just over 1000 more waiting behind it; nothing beyond, however
    # many turns the loop takes.
    await async_wait_for(lambda: backend.yielded >= 2200, "the fill to read 2200 bytes")
    for _ in range(100):
        await asyncio.sleep(0)
    assert backend.yielded == 2200 and not reading.done()
    stalled_disk.set()
    assert await asyncio.wait_for(reading, 5) == data
    await reader.settle(KEY)
    assert disk.contains(KEY) and backend.yielded == len(data)
