"""S3's conditional write (``If-None-Match: *``) on the store the tests use: probed at
start-up, sent on ``PutObject`` and ``CompleteMultipartUpload``, and a refused write
answered as "the key has an object" (False), never as a failure, leaving the first
body in place."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from crc32c import crc32c

from app.tiers.s3.backend import S3Backend
from app.tiers.s3.conditional import ConditionalWrites
from app.tiers.s3.transfers import put_file
from testkit.entries import body
from testkit.s3 import S3Endpoint
from tests.s3.conftest import MiB, StoreFactory, read_object

pytestmark = pytest.mark.anyio


async def test_the_probe_finds_both_writes_honoured(
    make_store: StoreFactory, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    backend = S3Backend(make_store())
    await backend.start()
    try:
        assert backend.conditional == ConditionalWrites(put=True, complete_multipart=True)
        assert backend.describe()["conditional_writes"] == {
            "put": True,
            "complete_multipart": True,
        }
        assert s3_endpoint.list_keys(s3_prefix + "/") == []  # the probe cleaned up
        assert s3_endpoint.list_uploads(s3_prefix + "/") == []
    finally:
        await backend.stop()


@pytest.mark.parametrize("size", [64 * 1024, 5 * MiB], ids=["single", "multipart"])
async def test_a_second_conditional_write_is_refused_and_the_first_body_stays(
    make_store: StoreFactory,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
    tmp_file: Callable[[bytes], Path],
    size: int,
) -> None:
    store = make_store(s3_multipart_threshold=5 * MiB, s3_multipart_part_size=5 * MiB)
    first, second = body((size,), "U8", 1, seed=1), body((size,), "U8", 1, seed=2)
    key = f"{s3_prefix}/cond/{size}"
    assert await put_file(store, key, tmp_file(first), crc32c=crc32c(first), if_absent=True)
    assert not await put_file(store, key, tmp_file(second), crc32c=crc32c(second), if_absent=True)
    assert await read_object(store, key) == first
    assert s3_endpoint.list_uploads(key) == []  # the refused multipart upload was aborted
    # Unconditional writes still overwrite (what a store that ignores the header does).
    assert await put_file(store, key, tmp_file(second), crc32c=crc32c(second))
    assert await read_object(store, key) == second
