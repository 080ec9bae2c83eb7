"""The read path's SigV4 signature (``app/tiers/s3/sigv4.py``) against botocore's
``S3SigV4Auth``, the reference it replaces: the same request signed at the same second
must carry the same headers, byte for byte. (Real S3 servers check it too: every
read-through test against SeaweedFS is signed this way.)"""

from __future__ import annotations

import datetime
import time
from unittest import mock
from urllib.parse import quote

import boto3
import botocore.exceptions as bce
import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from app.tiers.s3.sigv4 import GetSigner

#: Endpoints and the Host header each is reached with.
ENDPOINTS = [
    ("http://127.0.0.1:9000", "127.0.0.1:9000"),
    ("https://s3.example.com", "s3.example.com"),  # default port: none in Host
    ("http://MinIO.internal:9000/base/", "minio.internal:9000"),  # a path prefix
]
KEYS = [
    "ec/model/bfloat16/0123abcd.safetensors",
    "ec/Qwen/Qwen2-VL 7B/bfloat16/ü~x+y=z&q?%41.safetensors",  # quoted once, not normalized
]


def client(endpoint: str, region: str = "eu-west-3") -> object:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        aws_access_key_id="unused",
        aws_secret_access_key="unused",
    )


def botocore_headers(
    endpoint: str, region: str, credentials: Credentials, key: str, at: time.struct_time
) -> tuple[str, dict[str, str]]:
    url = f"{endpoint.rstrip('/')}/bucket/{quote(key, safe='/~')}"
    request = AWSRequest(method="GET", url=url, headers={"x-amz-checksum-mode": "ENABLED"})
    now = datetime.datetime(*at[:6])
    with mock.patch("botocore.auth.get_current_datetime", return_value=now):
        S3SigV4Auth(credentials.get_frozen_credentials(), "s3", region).add_auth(request)
    return request.url, {name.lower(): value for name, value in request.headers.items()}


@pytest.mark.parametrize(("endpoint", "host"), ENDPOINTS)
@pytest.mark.parametrize("token", [None, "session  token"])
def test_signs_what_botocore_signs(endpoint: str, host: str, token: str | None) -> None:
    credentials = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    signer = GetSigner(client(endpoint), "bucket", credentials)
    for key in KEYS:
        # Two days: the cached signing key must follow the date.
        for at in (time.gmtime(1_765_000_000), time.gmtime(1_765_000_000 + 86_400)):
            signed = signer.request(key, at)
            url, expected = botocore_headers(endpoint, "eu-west-3", credentials, key, at)
            assert {name.lower(): value for name, value in signed.headers.items()} == expected
            assert signed.url == url
            assert url.endswith(signed.path)
    assert signer.host == host


def test_refreshed_credentials_are_used_at_once() -> None:
    credentials = Credentials("AKID1", "secret-one")
    signer = GetSigner(client(ENDPOINTS[0][0], "us-east-1"), "bucket", credentials)
    at = time.gmtime(1_765_000_000)
    first = signer.request(KEYS[0], at).headers["Authorization"]
    credentials.access_key, credentials.secret_key = "AKID2", "secret-two"
    second = signer.request(KEYS[0], at)
    _, expected = botocore_headers(ENDPOINTS[0][0], "us-east-1", credentials, KEYS[0], at)
    assert second.headers["Authorization"] == expected["authorization"] != first


def test_no_credentials_fails_as_boto3_does() -> None:
    signer = GetSigner(client(ENDPOINTS[0][0]), "bucket", None)
    with pytest.raises(bce.NoCredentialsError):
        signer.request(KEYS[0])
