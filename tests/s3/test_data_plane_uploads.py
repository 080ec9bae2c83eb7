"""The data plane's uploads (``app.tiers.s3.data_plane``: ``PutObject`` and
``UploadPart`` on ``signed_http``, without boto3's pipeline) against the real S3
endpoint: the request is the one ``put_object`` sends, PUTs and part uploads go through
the one transport and boto3 only makes the control plane's calls, keys that need
percent-encoding read back, failures are retried (the body sent again from its start)
as boto3 retries them, and a body that cannot be rewound gets one attempt."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from app.checksum import crc32c as crc
from app.tiers.s3.errors import S3Error, S3Unavailable
from app.tiers.s3.objects import crc32c_to_b64
from app.tiers.s3.signing import USER_AGENT
from app.tiers.s3.transfers import object_metadata, put_file
from testkit.fault_proxy import FaultProxy
from testkit.s3 import S3Endpoint
from tests.s3.conftest import MiB, StoreFactory, read_object, write_object

pytestmark = pytest.mark.anyio

#: Headers that differ between any two requests (time, signature, SDK bookkeeping).
VOLATILE = {"user-agent", "x-amz-date", "authorization", "amz-sdk-invocation-id", "amz-sdk-request"}


def comparable(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower() not in VOLATILE}


async def test_the_request_is_the_one_put_object_sends(
    make_store: StoreFactory, s3_endpoint: S3Endpoint, s3_proxy: FaultProxy
) -> None:
    store = make_store(s3_endpoint_url=s3_proxy.url)
    data = os.urandom(MiB + 17)  # above 1 MiB: both ask for 100 Continue
    key = f"{store.prefix}/same-request.safetensors"
    metadata = object_metadata(crc(data), {"Origin": "test"})

    store.data_plane.put(
        key,
        io.BytesIO(data),
        len(data),
        content_type="application/octet-stream",
        checksum_crc32c=crc32c_to_b64(crc(data)),
        metadata=metadata,
    )
    store.client.put_object(  # what transfers sent before the data plane, same client
        Bucket=s3_endpoint.bucket,
        Key=key,
        Body=data,
        ContentLength=len(data),
        ContentType="application/octet-stream",
        ChecksumAlgorithm="CRC32C",
        ChecksumCRC32C=crc32c_to_b64(crc(data)),
        Metadata=metadata,
    )
    ours, boto3s = s3_proxy.headers_of("PUT")
    assert comparable(ours) == comparable(boto3s)
    assert ours["Expect"] == "100-continue"
    assert "x-amz-checksum-crc32c" in ours["Authorization"]  # the checksum is signed
    assert await read_object(store, key) == data

    small = b"small" * 100  # no 100 Continue round trip for it, where boto3 asks one
    await write_object(store, key, small, crc32c=crc(small))
    assert "Expect" not in s3_proxy.headers_of("PUT")[-1]
    assert await read_object(store, key) == small


def _requests(proxy: FaultProxy) -> list[tuple[str, str, str]]:
    """``(method, target, User-Agent)`` of every request the proxy saw, in order."""
    agents = {m: iter(proxy.headers_of(m)) for m in ("GET", "PUT", "POST", "HEAD", "DELETE")}
    return [
        (method, target, next(agents[method]).get("User-Agent", ""))
        for method, target in proxy.snapshot()
    ]


async def test_puts_and_part_uploads_go_through_the_one_transport(
    make_store: StoreFactory, s3_proxy: FaultProxy, tmp_file: Callable[[bytes], Path]
) -> None:
    """Every PutObject, UploadPart and GET is the data plane's own request (its
    ``User-Agent``), on one connection pool; boto3 makes only the control plane's calls
    (the multipart upload's create and complete)."""
    store = make_store(s3_endpoint_url=s3_proxy.url, s3_multipart_concurrency=1)
    assert store.data_plane.layer == "loop"
    single, multi = os.urandom(MiB + 1), os.urandom(2 * 5 * MiB + 7)  # threshold 8 MiB
    await put_file(
        store, f"{store.prefix}/single.safetensors", tmp_file(single), crc32c=crc(single)
    )
    await put_file(store, f"{store.prefix}/multi.safetensors", tmp_file(multi), crc32c=crc(multi))
    # The parts, one at a time, reused the single PUT's kept-alive connection: one pool
    # for the data plane's uploads, one for boto3's calls.
    assert s3_proxy.connections == 2
    assert await read_object(store, f"{store.prefix}/multi.safetensors") == multi
    seen = _requests(s3_proxy)
    ours = [(method, target) for method, target, agent in seen if agent == USER_AGENT]
    boto3s = [(method, target) for method, target, agent in seen if agent != USER_AGENT]
    parts = [target for method, target in ours if method == "PUT" and "partNumber=" in target]
    assert len(parts) == 3 and all("uploadId=" in target for target in parts)
    assert [m for m, _ in ours].count("PUT") == 1 + 3  # the single PUT and the 3 parts
    assert [m for m, _ in ours].count("GET") >= 1
    assert all(method == "POST" for method, _ in boto3s), boto3s  # create, complete
    assert len(boto3s) == 2 and all("Boto3" in agent for _, _, agent in seen if agent != USER_AGENT)


async def test_keys_that_need_percent_encoding_read_back(
    make_store: StoreFactory, s3_endpoint: S3Endpoint, tmp_file: Callable[[bytes], Path]
) -> None:
    store = make_store()
    data = os.urandom(300_000)
    key = f"{store.prefix}/org/model@rev/bfloat16/a b+c%20ü~:=.safetensors"
    await put_file(store, key, tmp_file(data), crc32c=crc(data))
    head = s3_endpoint.client().head_object(
        Bucket=s3_endpoint.bucket, Key=key, ChecksumMode="ENABLED"
    )
    assert head["ContentLength"] == len(data)
    assert head["ContentType"] == "application/octet-stream"
    assert head["Metadata"] == {"ec-crc32c": f"{crc(data):08x}"}
    assert head.get("ChecksumCRC32C") in (None, crc32c_to_b64(crc(data)))
    assert await read_object(store, key) == data


async def test_throttling_is_retried_with_the_body_sent_again(
    make_store: StoreFactory, s3_proxy: FaultProxy, tmp_file: Callable[[bytes], Path]
) -> None:
    store = make_store(s3_endpoint_url=s3_proxy.url, s3_max_attempts=3)
    data = os.urandom(3 * MiB + 5)
    key = f"{store.prefix}/retried.safetensors"

    s3_proxy.failures["PUT"] = 2  # SlowDown, read whole before it is answered
    await put_file(store, key, tmp_file(data), crc32c=crc(data))
    assert len(s3_proxy.headers_of("PUT")) == 3
    assert await read_object(store, key) == data  # sent whole again from its start
    assert store.breaker.available

    small = b"retried bytes" * 100
    s3_proxy.failures["PUT"] = 1
    s3_proxy.reset()
    await write_object(store, key, small, crc32c=crc(small))
    assert len(s3_proxy.headers_of("PUT")) == 2
    assert await read_object(store, key) == small

    s3_proxy.failures["PUT"] = 3
    s3_proxy.reset()
    with pytest.raises(S3Unavailable, match="SlowDown"):
        await write_object(store, key, data, crc32c=crc(data))
    assert len(s3_proxy.headers_of("PUT")) == 3
    assert not store.breaker.available  # the breaker opened after the last attempt
    assert await read_object(make_store(), key) == small  # the failed upload changed nothing


async def test_a_client_error_is_not_retried(
    make_store: StoreFactory, s3_proxy: FaultProxy
) -> None:
    store = make_store(s3_endpoint_url=s3_proxy.url, s3_max_attempts=3)
    s3_proxy.failures["PUT"], s3_proxy.status = 1, 403
    data = b"forbidden" * 10
    with pytest.raises(S3Error) as caught:
        await write_object(store, f"{store.prefix}/forbidden.safetensors", data, crc32c=crc(data))
    assert caught.value.status == 403 and not isinstance(caught.value, S3Unavailable)
    assert len(s3_proxy.headers_of("PUT")) == 1
    assert store.breaker.available  # it answered


async def test_a_body_that_cannot_be_rewound_gets_one_attempt(
    make_store: StoreFactory, s3_proxy: FaultProxy
) -> None:
    class OneWay(io.RawIOBase):
        """A body that can be read once, as a streaming upload's pipe."""

        def __init__(self, data: bytes) -> None:
            self._data = io.BytesIO(data)

        def readable(self) -> bool:
            return True

        def read(self, size: int = -1) -> bytes:
            return self._data.read(size)

    store = make_store(s3_endpoint_url=s3_proxy.url, s3_max_attempts=3)
    s3_proxy.failures["PUT"] = 1
    data = os.urandom(200_000)
    with pytest.raises(S3Unavailable, match="SlowDown"):
        await store.call(
            "put",
            lambda: store.data_plane.put(
                f"{store.prefix}/one-way.safetensors",
                OneWay(data),
                len(data),
                content_type="application/octet-stream",
                checksum_crc32c=crc32c_to_b64(crc(data)),
                metadata={},
            ),
        )
    assert len(s3_proxy.headers_of("PUT")) == 1


async def test_a_wrong_secret_is_a_credentials_error_not_retried(
    make_store: StoreFactory,
) -> None:
    store = make_store(secret_access_key="definitely-wrong-secret", s3_max_attempts=3)
    data = b"x" * 1000
    with pytest.raises(S3Error) as caught:
        await write_object(store, f"{store.prefix}/denied.safetensors", data, crc32c=crc(data))
    assert caught.value.status == 403 and not isinstance(caught.value, S3Unavailable)
    assert store.breaker.available


async def test_uploads_go_through_a_proxy(
    make_store: StoreFactory,
    s3_proxy: FaultProxy,
    tmp_file: Callable[[bytes], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", s3_proxy.url)
    store = make_store()  # botocore's transport picks the proxy up, as boto3's does
    assert store.data_plane.layer == "botocore"
    data, large = os.urandom(2 * MiB + 3), os.urandom(2 * 5 * MiB + 1)
    key = f"{store.prefix}/proxied.safetensors"
    await put_file(store, key, tmp_file(data), crc32c=crc(data))
    assert len(s3_proxy.headers_of("PUT")) == 1  # the front saw the PUT, as a proxy
    await put_file(store, key + "-parts", tmp_file(large), crc32c=crc(large))
    assert s3_proxy.count("PUT", "partNumber=") == 3  # and each part
    monkeypatch.delenv("HTTP_PROXY")
    assert await read_object(make_store(), key) == data
    assert await read_object(make_store(), key + "-parts") == large
