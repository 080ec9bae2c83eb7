"""Uploads: one ``PutObject`` below the multipart threshold, multipart above it.

Every upload carries the entry's CRC32C twice: as the S3 object checksum
(``ChecksumAlgorithm=CRC32C``), so the endpoint refuses a body that does not match (single
PUT: the whole-object CRC; multipart: one CRC per part, and the parts' CRCs combined with
:func:`crc32c_combine` are checked locally against the expected one before the upload is
completed), and as user metadata ``x-amz-meta-ec-crc32c``, because endpoints differ in
what they return on HEAD (composite ``...-N`` checksums for multipart, or none at all).

Neither ``crc32c`` (2.9) nor ``google-crc32c`` (1.9) offers a combine, so the GF(2) maths
of zlib's ``crc32_combine`` lives here (tested against whole-body CRCs in
``tests/unit/test_s3_transfers.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from app.checksum import crc32c as crc32c_of
from app.tiers.s3.client import METADATA_CRC_KEY, S3Client, crc32c_to_b64
from app.tiers.s3.errors import S3Error

log = logging.getLogger(__name__)

MiB = 1024 * 1024
#: S3 refuses multipart parts smaller than this (except the last one).
MIN_PART_SIZE = 5 * MiB
#: S3 allows at most this many parts in one multipart upload.
MAX_PARTS = 10_000

# --------------------------------------------------------------------------- crc combine

_CRC32C_POLY_REVERSED = 0x82F63B78


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (zlib's algorithm)."""
    if len2 <= 0:
        return crc1
    odd = [_CRC32C_POLY_REVERSED] + [1 << n for n in range(31)]  # operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return (crc1 ^ crc2) & 0xFFFFFFFF


# --------------------------------------------------------------------------- uploads


def object_metadata(crc32c: int, metadata: Mapping[str, str] | None) -> dict[str, str]:
    """User metadata of an upload: ``metadata`` plus the ``ec-crc32c`` of the body."""
    meta = {str(k).lower(): str(v) for k, v in (metadata or {}).items()}
    meta[METADATA_CRC_KEY] = f"{crc32c & 0xFFFFFFFF:08x}"
    return meta


def _put_object(
    s3: S3Client, key: str, body: Any, size: int, crc32c: int, metadata: Mapping[str, str] | None
) -> None:
    s3.client.put_object(
        Bucket=s3.bucket,
        Key=key,
        Body=body,
        ContentLength=size,
        ContentType="application/octet-stream",
        ChecksumAlgorithm="CRC32C",
        ChecksumCRC32C=crc32c_to_b64(crc32c),
        Metadata=object_metadata(crc32c, metadata),
    )
    s3.metrics.bytes_up.inc(size)


async def put_bytes(
    s3: S3Client,
    key: str,
    data: bytes,
    *,
    crc32c: int,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Single PUT of an in-memory body (tests, small objects)."""
    await s3.call("put", lambda: _put_object(s3, key, data, len(data), crc32c, metadata))


async def put_file(
    s3: S3Client,
    key: str,
    path: str | os.PathLike[str],
    *,
    crc32c: int,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Upload a local file as ``key``. ``crc32c`` is the CRC32C of the whole file; S3
    verifies it (single PUT) or each part's CRC (multipart, where the combined CRC is
    also checked locally before the upload is completed). On any failure nothing is
    left visible under ``key`` (a failed multipart upload is aborted, best effort)."""
    size = os.stat(path).st_size
    if size < s3.settings.s3_multipart_threshold:

        def _single() -> None:
            with open(path, "rb") as f:
                _put_object(s3, key, f, size, crc32c, metadata)

        await s3.call("put", _single)
    else:
        await _put_multipart(s3, key, os.fspath(path), size, crc32c, metadata)


def part_size_for(size: int, part_size: int) -> int:
    """``part_size``, doubled until ``size`` fits in ``MAX_PARTS`` parts."""
    while -(-size // part_size) > MAX_PARTS:
        part_size *= 2
    return part_size


async def _put_multipart(
    s3: S3Client,
    key: str,
    path: str,
    size: int,
    crc32c: int,
    metadata: Mapping[str, str] | None,
) -> None:
    part_size = part_size_for(size, s3.settings.s3_multipart_part_size)
    resp = await s3.call(
        "create_multipart",
        lambda: s3.client.create_multipart_upload(
            Bucket=s3.bucket,
            Key=key,
            ContentType="application/octet-stream",
            ChecksumAlgorithm="CRC32C",
            Metadata=object_metadata(crc32c, metadata),
        ),
    )
    assert resp is not None
    upload_id = str(resp["UploadId"])
    offsets = list(range(0, size, part_size)) or [0]
    results: list[tuple[str, int, int] | None] = [None] * len(offsets)
    semaphore = asyncio.Semaphore(s3.settings.s3_multipart_concurrency)
    completed = False
    try:

        def _upload(index: int, offset: int) -> tuple[str, int, int]:
            length = min(part_size, size - offset)
            # Each part opens the file itself: a part still running on the pool after
            # a cancellation must never read through a reused file descriptor.
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), length, offset)
            if len(data) != length:
                raise S3Error(f"local file {path} shrank while uploading {key}")
            part_crc = crc32c_of(data)
            r = s3.client.upload_part(
                Bucket=s3.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=index + 1,
                Body=data,
                ContentLength=length,
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=crc32c_to_b64(part_crc),
            )
            s3.metrics.bytes_up.inc(length)
            return str(r["ETag"]), part_crc, length

        async def _one(index: int, offset: int) -> None:
            async with semaphore:
                results[index] = await s3.call("upload_part", lambda: _upload(index, offset))

        tasks = [asyncio.create_task(_one(i, off)) for i, off in enumerate(offsets)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

        combined = 0
        parts: list[dict[str, Any]] = []
        for index, item in enumerate(results):
            assert item is not None
            etag, part_crc, length = item
            combined = part_crc if index == 0 else crc32c_combine(combined, part_crc, length)
            parts.append(
                {
                    "PartNumber": index + 1,
                    "ETag": etag,
                    "ChecksumCRC32C": crc32c_to_b64(part_crc),
                }
            )
        if combined != crc32c & 0xFFFFFFFF:
            raise S3Error(
                f"checksum mismatch uploading {key}: file has crc32c {combined:08x}, "
                f"expected {crc32c & 0xFFFFFFFF:08x}",
                code="BadDigest",
            )
        await s3.call(
            "complete_multipart",
            lambda: s3.client.complete_multipart_upload(
                Bucket=s3.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            ),
        )
        completed = True
    finally:
        if not completed:
            await asyncio.shield(_abort_multipart(s3, key, upload_id))


async def _abort_multipart(s3: S3Client, key: str, upload_id: str) -> None:
    try:
        await s3.call(
            "abort_multipart",
            lambda: s3.client.abort_multipart_upload(Bucket=s3.bucket, Key=key, UploadId=upload_id),
            not_found_ok=True,
            breaker=False,
        )
    except S3Error as exc:
        # The parts stay invisible (no object exists under the key); a bucket lifecycle
        # rule AbortIncompleteMultipartUpload reclaims their space.
        log.warning("could not abort multipart upload %s of %s: %s", upload_id, key, exc)
