"""The S3 backend's pure helpers: CRC32C combine (multipart check), checksum wire form,
part sizes, upload metadata, the mapped file body. The uploads themselves run against S3
in tests/s3."""

from __future__ import annotations

import io
import os
from pathlib import Path

from app.checksum import crc32c as crc
from app.tiers.s3.objects import METADATA_CRC_KEY, crc32c_from_b64, crc32c_to_b64
from app.tiers.s3.transfers import (
    MAX_PARTS,
    MappedFileBody,
    crc32c_combine,
    object_metadata,
    part_size_for,
)

#: S3 refuses multipart parts smaller than this (except the last one).
MIN_PART_SIZE = 5 * 1024 * 1024


def test_crc32c_combine_matches_whole_crc() -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    for cut in (0, 1, 5, 1024 * 1024, len(data) - 1, len(data)):
        a, b = data[:cut], data[cut:]
        assert crc32c_combine(crc(a), crc(b), len(b)) == crc(data)


def test_crc32c_combine_of_many_parts() -> None:
    parts = [os.urandom(n) for n in (5, 4096, 1, 70_001, 3)]
    combined = crc(parts[0])
    for part in parts[1:]:
        combined = crc32c_combine(combined, crc(part), len(part))
    assert combined == crc(b"".join(parts))


def test_crc32c_base64_round_trip() -> None:
    for value in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
        assert crc32c_from_b64(crc32c_to_b64(value)) == value
    assert crc32c_from_b64("not base64!") is None


def test_part_size_grows_to_fit_the_part_limit() -> None:
    assert part_size_for(100 * MIN_PART_SIZE, MIN_PART_SIZE) == MIN_PART_SIZE
    big = MAX_PARTS * MIN_PART_SIZE + 1
    size = part_size_for(big, MIN_PART_SIZE)
    assert size == 2 * MIN_PART_SIZE and -(-big // size) <= MAX_PARTS


def test_object_metadata_carries_the_crc() -> None:
    meta = object_metadata(0xABC, {"EC-Shape": "2,3"})
    assert meta == {"ec-shape": "2,3", METADATA_CRC_KEY: "00000abc"}


def test_mapped_file_body_reads_whole_mebibytes_and_replays(tmp_path: Path) -> None:
    data = os.urandom(2 * MappedFileBody.READ_SIZE + 5)
    (tmp_path / "f").write_bytes(data)
    body = MappedFileBody(tmp_path / "f")
    # urllib3 asks for 16 KiB: each read answers a MiB (the last one the rest), then b"".
    reads = [bytes(body.read(16384)) for _ in range(4)]
    assert [len(r) for r in reads] == [MappedFileBody.READ_SIZE] * 2 + [5, 0]
    assert b"".join(reads) == data
    assert body.tell() == len(data)
    assert body.seek(0) == 0  # a retry replays the body from the start
    assert bytes(body.read()) == data
    assert body.seek(-5, io.SEEK_END) == len(data) - 5 and bytes(body.read(1)) == data[-5:]
    (tmp_path / "empty").write_bytes(b"")
    assert bytes(MappedFileBody(tmp_path / "empty").read(16384)) == b""
