"""The S3 tier's own requests (``signing``, ``http_session``): signed as botocore signs a
request it makes itself, on a transport made from the boto3 client's settings. (Real S3
servers check the signatures too: every read-through and upload test against SeaweedFS
is signed this way.)"""

from __future__ import annotations

import datetime
from unittest import mock
from urllib.parse import quote

import botocore.exceptions as bce
import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials

from app.tiers.s3.http_session import s3_transport
from app.tiers.s3.signing import USER_AGENT, Signer

#: Endpoints and the Host header each is reached with.
ENDPOINTS = [
    ("http://127.0.0.1:9000", "127.0.0.1:9000"),
    ("https://s3.example.com", "s3.example.com"),  # default port: none in Host
    ("https://s3.example.com:443", "s3.example.com"),
    ("http://[::1]:9000", "[::1]:9000"),
    ("http://MinIO.internal:9000/base/", "minio.internal:9000"),  # a path prefix
]
KEYS = [
    "ec/model/bfloat16/0123abcd.safetensors",
    "ec/Qwen/Qwen2-VL 7B/bfloat16/ü~x+y=z&q?%41.safetensors",  # quoted once, not normalized
]
CONFIG = Config(s3={"addressing_style": "path", "payload_signing_enabled": False})
AT = datetime.datetime(2026, 12, 7, 1, 2, 3)


def botocore_signed(endpoint: str, key: str, credentials: Credentials) -> AWSRequest:
    """The GET botocore signs itself (its own Host) for the same object."""
    url = f"{endpoint.rstrip('/')}/bucket/{quote(key, safe='/~')}"
    request = AWSRequest(method="GET", url=url, headers={"x-amz-checksum-mode": "ENABLED"})
    S3SigV4Auth(credentials.get_frozen_credentials(), "s3", "eu-west-3").add_auth(request)
    return request


@pytest.mark.parametrize(("endpoint", "host"), ENDPOINTS)
@pytest.mark.parametrize("token", [None, "session  token"])
def test_get_is_signed_as_botocore_signs_it(endpoint: str, host: str, token: str | None) -> None:
    credentials = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    transport = s3_transport(endpoint, True, CONFIG)
    assert transport.host == host
    signer = Signer(transport, "bucket", "eu-west-3", CONFIG, credentials)
    for key in KEYS:
        with mock.patch("botocore.auth.get_current_datetime", return_value=AT):
            signed = signer.get(key)
            expected = botocore_signed(endpoint, key, credentials)
        ours = {name.lower(): value for name, value in signed.headers.items()}
        assert ours.pop("host") == host
        assert ours.pop("user-agent") == USER_AGENT  # not signed, as botocore leaves it
        assert ours == {name.lower(): value for name, value in expected.headers.items()}
        assert signed.url == expected.url
        assert expected.url.endswith(signed.path)


def test_uploads_follow_the_clients_payload_signing() -> None:
    transport = s3_transport("http://127.0.0.1:9000", True, CONFIG)
    signer = Signer(transport, "bucket", "us-east-1", CONFIG, Credentials("AKID", "secret"))
    signed = signer.put(KEYS[0], {"x-amz-checksum-crc32c": "AAAAAA=="}, b"body")
    assert signed.headers["X-Amz-Content-SHA256"] == "UNSIGNED-PAYLOAD"
    assert "x-amz-checksum-crc32c" in signed.headers["Authorization"]


def test_refreshed_credentials_are_used_at_once() -> None:
    credentials = Credentials("AKID1", "secret-one")
    transport = s3_transport("http://127.0.0.1:9000", True, CONFIG)
    signer = Signer(transport, "bucket", "us-east-1", CONFIG, credentials)
    first = signer.get(KEYS[0]).headers["Authorization"]
    credentials.access_key, credentials.secret_key = "AKID2", "secret-two"
    assert "Credential=AKID2/" in signer.get(KEYS[0]).headers["Authorization"] != first


def test_no_credentials_fails_as_boto3_does() -> None:
    transport = s3_transport("http://127.0.0.1:9000", True, CONFIG)
    signer = Signer(transport, "bucket", "us-east-1", CONFIG, None)
    with pytest.raises(bce.NoCredentialsError):
        signer.get(KEYS[0])


def test_transport_takes_the_clients_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "minio.local")
    assert s3_transport("http://s3.internal:9000", False, CONFIG).proxy_url == (
        "http://proxy.internal:3128"
    )
    assert s3_transport("http://minio.local:9000", True, CONFIG).proxy_url is None
    configured = Config(proxies={"http": "http://other:8080"})
    assert s3_transport("http://minio.local:9000", True, configured).proxy_url == (
        "http://other:8080"
    )
    transport = s3_transport("https://s3.example.com", "/etc/ca.pem", CONFIG)
    assert transport.verify == "/etc/ca.pem"
    assert transport.endpoint == "https://s3.example.com"


def test_a_part_upload_is_signed_as_botocore_signs_it() -> None:
    """``UploadPart``'s query (part number, upload id) is in the URL and the signature."""
    credentials = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    transport = s3_transport("http://127.0.0.1:9000", True, CONFIG)
    signer = Signer(transport, "bucket", "eu-west-3", CONFIG, credentials)
    query = "partNumber=2&uploadId=a%2Bb%2Fc"
    headers = {"Content-Length": "4", "x-amz-checksum-crc32c": "AAAAAA=="}
    with mock.patch("botocore.auth.get_current_datetime", return_value=AT):
        signed = signer.put(KEYS[1], headers, b"body", query)
        url = f"http://127.0.0.1:9000/bucket/{quote(KEYS[1], safe='/~')}?{query}"
        expected = AWSRequest(method="PUT", url=url, headers=headers, data=b"body")
        expected.context["client_config"] = CONFIG
        S3SigV4Auth(credentials.get_frozen_credentials(), "s3", "eu-west-3").add_auth(expected)
    assert signed.url == url and signed.path.endswith(f"?{query}")
    assert signed.headers["Authorization"] == expected.headers["Authorization"]
