"""The S3 backend's client, transfers and readiness against a real S3 endpoint (SeaweedFS
or EC_TEST_S3_*)."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from app.checksum import crc32c as crc
from app.keys import EntryKey
from app.tiers.s3.client import S3Client
from app.tiers.s3.download import FIRST_READ_BYTES
from app.tiers.s3.errors import S3Error, S3Unavailable
from app.tiers.s3.objects import METADATA_CRC_KEY, crc32c_to_b64
from app.tiers.s3.readiness import check_ready, ensure_bucket
from app.tiers.s3.transfers import put_file
from testkit.fault_proxy import FaultProxy
from testkit.ports import free_ports
from testkit.s3 import S3Endpoint
from tests.s3.conftest import MiB, S3Control, StoreFactory, read_object, write_object

pytestmark = pytest.mark.anyio


def sample(size: int, seed: int = 0) -> bytes:
    return (seed.to_bytes(4, "little") + os.urandom(16)) * (size // 20) + os.urandom(size % 20)


# ------------------------------------------------------------------ pure helpers


def key_for(store: S3Client, model: str, dtype: str, hash_: str) -> str:
    return EntryKey(model, dtype, hash_).object_key(store.prefix)


async def test_key_layout(make_store: StoreFactory, s3_prefix: str) -> None:
    store = make_store()
    assert (
        key_for(store, "Qwen/Qwen2.5-VL-7B-Instruct", "bfloat16", "ab:12")
        == f"{s3_prefix}/Qwen/Qwen2.5-VL-7B-Instruct/bfloat16/ab:12.safetensors"
    )
    assert key_for(make_store(s3_prefix=""), "m", "int8", "h") == "m/int8/h.safetensors"


# ------------------------------------------------------------------ round trips


async def test_put_head_get_round_trip(
    make_store: StoreFactory,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
    tmp_file: Callable[[bytes], Path],
) -> None:
    store = make_store()
    data = sample(300_000)
    key = key_for(store, "org/model@rev", "float16", "a" * 64)
    await put_file(store, key, tmp_file(data), crc32c=crc(data))

    info = await store.head(key)
    assert info is not None
    assert (info.size, info.crc32c) == (len(data), crc(data))
    assert info.metadata[METADATA_CRC_KEY] == f"{crc(data):08x}"
    assert await read_object(store, key) == data

    # Human readable in listings (mc ls / aws s3 ls).
    assert s3_endpoint.list_keys(s3_prefix + "/") == [key]
    # The object's own checksum is the entry's CRC32C (single PUT).
    head = s3_endpoint.client().head_object(
        Bucket=s3_endpoint.bucket, Key=key, ChecksumMode="ENABLED"
    )
    assert head.get("ChecksumCRC32C") in (None, crc32c_to_b64(crc(data)))


async def test_get_streams_in_chunks(make_store: StoreFactory) -> None:
    store = make_store(s3_get_chunk_size=256 * 1024)
    data = sample(1_000_000)
    key = key_for(store, "m", "uint8", "stream")
    await write_object(store, key, data, crc32c=crc(data))
    download = await store.open(key)
    assert download is not None
    async with contextlib.aclosing(download):
        assert download.info.size == len(data)
        sizes = [len(chunk) async for chunk in download.chunks()]
    assert sum(sizes) == len(data)
    assert len(sizes) >= 4 and max(sizes) <= 256 * 1024
    # Small, and handed over as it arrives: a header is known after one round trip.
    assert 0 < sizes[0] <= FIRST_READ_BYTES


async def test_object_within_the_first_read(make_store: StoreFactory) -> None:
    store = make_store()
    data = sample(1000, seed=5)
    key = key_for(store, "m", "uint8", "small")
    await write_object(store, key, data, crc32c=crc(data))
    download = await store.open(key)
    assert download is not None
    async with contextlib.aclosing(download):
        chunks = [chunk async for chunk in download.chunks()]
    assert chunks == [data]


async def test_multipart_above_threshold(
    make_store: StoreFactory,
    s3_endpoint: S3Endpoint,
    s3_proxy: FaultProxy,
    tmp_file: Callable[[bytes], Path],
) -> None:
    # 20 MB with an 8 MiB threshold and 5 MiB parts: 4 parts, each with its own CRC32C.
    store = make_store(s3_endpoint_url=s3_proxy.url)
    data = sample(20_000_000, seed=1)
    key = key_for(store, "m", "bfloat16", "multipart")
    await put_file(store, key, tmp_file(data), crc32c=crc(data))

    parts = [path for method, path in s3_proxy.snapshot() if method == "PUT"]
    assert len(parts) == 4 and all("partNumber=" in path for path in parts)
    info = await store.head(key)
    assert info is not None
    assert (info.size, info.crc32c) == (len(data), crc(data))  # from x-amz-meta-ec-crc32c
    assert await read_object(store, key) == data
    assert s3_endpoint.list_uploads(key) == []


async def test_single_put_with_wrong_crc_is_refused_by_s3(
    make_store: StoreFactory, tmp_file: Callable[[bytes], Path]
) -> None:
    store = make_store()
    data = sample(100_000)
    key = key_for(store, "m", "float32", "badcrc")
    with pytest.raises(S3Error) as caught:
        await put_file(store, key, tmp_file(data), crc32c=crc(data) ^ 1)
    assert not isinstance(caught.value, S3Unavailable)
    assert caught.value.status == 400 or caught.value.code in ("BadDigest", "InvalidRequest")
    assert await store.head(key) is None


async def test_multipart_with_wrong_crc_leaves_nothing(
    make_store: StoreFactory, s3_endpoint: S3Endpoint, tmp_file: Callable[[bytes], Path]
) -> None:
    store = make_store()
    data = sample(12 * MiB, seed=2)
    key = key_for(store, "m", "float32", "badcrc-multipart")
    with pytest.raises(S3Error, match="checksum mismatch"):
        await put_file(store, key, tmp_file(data), crc32c=crc(data) ^ 0x100)
    assert await store.head(key) is None
    assert s3_endpoint.list_uploads(key) == []  # aborted


async def test_delete_and_missing_keys(make_store: StoreFactory) -> None:
    store = make_store()
    data = sample(1000)
    key = key_for(store, "m", "int8", "gone")
    await write_object(store, key, data, crc32c=crc(data))
    assert await store.head(key) is not None
    await store.delete(key)
    assert await store.head(key) is None
    assert await store.open(key) is None
    assert await read_object(store, key) is None
    await store.delete(key)  # deleting an absent object is fine


async def test_metrics_count_requests_and_bytes(make_store: StoreFactory) -> None:
    store = make_store()
    data = sample(50_000)
    key = key_for(store, "m", "int8", "metrics")
    await write_object(store, key, data, crc32c=crc(data))
    await read_object(store, key)
    await store.head(key_for(store, "m", "int8", "absent"))
    reg = store.metrics.registry

    def value(name: str, **labels: str) -> float:
        return reg.get_sample_value(name, labels) or 0.0

    assert value("ec_s3_requests_total", operation="put", outcome="ok") == 1
    assert value("ec_s3_requests_total", operation="get", outcome="ok") == 1
    assert value("ec_s3_requests_total", operation="head", outcome="not_found") == 1
    assert value("ec_s3_bytes_total", direction="up") == len(data)
    assert value("ec_s3_bytes_total", direction="down") == len(data)
    assert value("ec_s3_request_duration_seconds_count", operation="put") == 1


# ------------------------------------------------------------------ readiness


async def test_ready_when_all_is_well(make_store: StoreFactory) -> None:
    state = await check_ready(make_store())
    assert state.ok and state.state == "ok", state


async def test_wrong_secret_key_is_a_credentials_problem(make_store: StoreFactory) -> None:
    store = make_store(secret_access_key="definitely-wrong-secret")
    state = await check_ready(store)
    assert not state.ok and state.state == "credentials", state
    assert "credentials" in state.reason
    with pytest.raises(S3Error) as caught:
        await store.head(key_for(store, "m", "int8", "x"))
    assert not isinstance(caught.value, S3Unavailable)


async def test_unknown_access_key_is_a_credentials_problem(make_store: StoreFactory) -> None:
    state = await check_ready(make_store(access_key_id="NOSUCHKEY0000000", secret_access_key="x"))
    assert not state.ok and state.state == "credentials", state


async def test_missing_bucket(make_store: StoreFactory, s3_endpoint: S3Endpoint) -> None:
    name = f"ec-missing-{uuid.uuid4().hex[:10]}"
    store = make_store(s3_bucket=name)
    state = await check_ready(store)
    assert not state.ok and state.state == "no_bucket", state
    assert name in state.reason and "EC_S3_CREATE_BUCKET" in state.reason
    assert await ensure_bucket(store) is False

    creating = make_store(s3_bucket=name, s3_create_bucket=True)
    try:
        assert await ensure_bucket(creating) is True
        assert (await check_ready(creating)).ok
        assert await ensure_bucket(creating) is True  # idempotent
    finally:
        s3_endpoint.client().delete_bucket(Bucket=name)


# ------------------------------------------------------------------ outages


async def test_nothing_listening_is_unavailable(make_store: StoreFactory) -> None:
    (port,) = free_ports(1)
    store = make_store(s3_endpoint_url=f"http://127.0.0.1:{port}", s3_unavailable_cooldown=30)
    started = time.monotonic()
    with pytest.raises(S3Unavailable):
        await store.head(key_for(store, "m", "int8", "x"))
    # The breaker is open now: the next call fails at once, without a connection attempt.
    with pytest.raises(S3Unavailable, match="marked unavailable"):
        await store.open(key_for(store, "m", "int8", "x"))
    assert time.monotonic() - started < 10
    assert store.breaker.retry_after() > 1
    state = await check_ready(store)
    assert not state.ok and state.state == "unreachable", state


async def test_s3_stopped_then_restarted(make_store: StoreFactory, s3_control: S3Control) -> None:
    store = make_store(s3_unavailable_cooldown=0.2)
    data = sample(10_000)
    key = key_for(store, "m", "int8", "outage")
    await write_object(store, key, data, crc32c=crc(data))

    s3_control.stop()
    with pytest.raises(S3Unavailable):
        await store.head(key)
    with pytest.raises(S3Unavailable):
        await write_object(store, key + "2", data, crc32c=crc(data))
    state = await check_ready(store)
    assert not state.ok and state.state == "unreachable", state

    s3_control.start()
    time.sleep(0.3)  # past the cooldown: the next call probes again
    assert (await check_ready(store)).ok
    assert await read_object(store, key) == data


async def test_connection_cut_mid_body_is_unavailable(
    make_store: StoreFactory, s3_proxy: FaultProxy
) -> None:
    store = make_store(s3_endpoint_url=s3_proxy.url, s3_get_chunk_size=64 * 1024)
    data = sample(8 * MiB, seed=3)
    key = key_for(store, "m", "uint8", "cut")
    await write_object(store, key, data, crc32c=crc(data))
    download = await store.open(key)
    assert download is not None
    with pytest.raises(S3Unavailable):
        async with contextlib.aclosing(download):
            async for _ in download.chunks():
                s3_proxy.down = True
    assert not store.breaker.available  # breaker opened by the broken body
