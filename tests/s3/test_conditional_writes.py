"""S3's conditional write (``If-None-Match: *``) on the store the tests use: probed at
start-up, sent on ``PutObject`` and ``CompleteMultipartUpload``, and a refused write
answered as "the key has an object" (False), never as a failure, leaving the first
body in place."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from crc32c import crc32c

from app.keys import EntryKey
from app.safetensors_format import validate_body
from app.tiers.s3.backend import S3Backend
from app.tiers.s3.conditional import ConditionalWrites
from app.tiers.s3.transfers import put_file
from testkit.entries import body
from testkit.fault_proxy import FaultProxy
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


@pytest.mark.parametrize("honoured", [True, False], ids=["conditional", "head-first"])
async def test_the_backend_sends_the_header_only_where_honoured(
    make_store: StoreFactory,
    s3_proxy: FaultProxy,
    tmp_file: Callable[[bytes], Path],
    honoured: bool,
) -> None:
    """Where the probe found the header honoured, a PUT carries it and no HEAD goes
    first; where it did not (or has not run yet), a HEAD asks first and the PUT goes
    without it. Either way a second body of the key is refused (False)."""
    backend = S3Backend(make_store(s3_endpoint_url=s3_proxy.url))
    backend.conditional = ConditionalWrites(put=honoured, complete_multipart=honoured)
    key = EntryKey("cond/m", "uint8", "k")
    first, second = body((4096,), "U8", 1, seed=3), body((4096,), "U8", 1, seed=4)
    header = validate_body(first, "uint8")
    try:
        assert await backend.put_file(key, tmp_file(first), crc32c(first), header)
        [put] = [{k.lower(): v for k, v in h.items()} for h in s3_proxy.headers_of("PUT")]
        assert (put.get("if-none-match") == "*") is honoured
        assert s3_proxy.count("HEAD") == (0 if honoured else 1)
        assert not await backend.put_file(key, tmp_file(second), crc32c(second), header)
        assert s3_proxy.count("PUT") == (2 if honoured else 1)
        opened = await backend.open(key)
        assert opened is not None
        async with opened:
            assert b"".join([bytes(c) async for c in opened.chunks()]) == first
    finally:
        await backend.stop()
