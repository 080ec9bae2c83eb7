"""The read path's GET (``S3Client.open``: ``app/tiers/s3/loop_get.py``) against a real S3
endpoint: object keys that need percent-encoding, the answers boto3 would turn into
errors, and retries, through a front that answers S3 errors before passing requests
on to the real endpoint."""

from __future__ import annotations

import contextlib
import uuid

import pytest

from app.checksum import crc32c as crc
from app.tiers.s3.errors import S3Error, S3Unavailable
from testkit.fault_proxy import FaultProxy
from testkit.s3 import S3Endpoint
from tests.s3.conftest import StoreFactory, read_object, write_object

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "name",
    ["plain-name", "with space", "plus+equals=and&amp", "percent%2Fnot-a-slash", "tilde~ünï"],
)
async def test_keys_that_need_encoding_are_signed_and_read_back(
    make_store: StoreFactory, name: str
) -> None:
    store = make_store()
    key = f"{store.prefix}/org/model/bfloat16/{name}.safetensors"
    data = f"body of {name}".encode() * 100
    await write_object(store, key, data, crc32c=crc(data))
    download = await store.open(key)
    assert download is not None
    assert (download.info.size, download.info.crc32c) == (len(data), crc(data))
    async with contextlib.aclosing(download):
        assert b"".join([bytes(chunk) async for chunk in download.chunks()]) == data


async def test_what_boto3_reports_as_errors(
    make_store: StoreFactory, s3_endpoint: S3Endpoint
) -> None:
    store = make_store()
    assert await read_object(store, f"{store.prefix}/absent.safetensors") is None

    missing_bucket = make_store(s3_bucket=f"ec-missing-{uuid.uuid4().hex[:10]}")
    with pytest.raises(S3Error) as caught:
        await read_object(missing_bucket, f"{store.prefix}/absent.safetensors")
    assert caught.value.code == "NoSuchBucket" and not isinstance(caught.value, S3Unavailable)

    wrong_secret = make_store(secret_access_key="definitely-wrong-secret")
    with pytest.raises(S3Error) as caught:
        await read_object(wrong_secret, f"{store.prefix}/absent.safetensors")
    assert caught.value.code == "SignatureDoesNotMatch", caught.value
    assert not isinstance(caught.value, S3Unavailable)


async def test_throttling_is_retried_up_to_max_attempts(
    make_store: StoreFactory, s3_proxy: FaultProxy
) -> None:
    store = make_store(s3_endpoint_url=s3_proxy.url, s3_max_attempts=3)
    key = f"{store.prefix}/retried.safetensors"
    data = b"retried" * 1000
    await write_object(make_store(), key, data, crc32c=crc(data))  # the front passes GETs only

    s3_proxy.failures["GET"] = 2
    s3_proxy.reset()
    assert await read_object(store, key) == data
    assert s3_proxy.count("GET") == 3  # two answered SlowDown, the third went through
    assert store.breaker.available

    s3_proxy.failures["GET"] = 3
    s3_proxy.reset()
    with pytest.raises(S3Unavailable, match="SlowDown"):
        await read_object(store, key)
    assert s3_proxy.count("GET") == 3
    assert not store.breaker.available  # the breaker opened after the last attempt


async def test_a_client_error_is_not_retried(
    make_store: StoreFactory, s3_proxy: FaultProxy
) -> None:
    store = make_store(s3_endpoint_url=s3_proxy.url, s3_max_attempts=3)
    s3_proxy.failures["GET"], s3_proxy.status = 1, 403
    s3_proxy.reset()
    with pytest.raises(S3Error) as caught:
        await read_object(store, f"{store.prefix}/forbidden.safetensors")
    assert caught.value.status == 403 and not isinstance(caught.value, S3Unavailable)
    assert s3_proxy.count("GET") == 1
