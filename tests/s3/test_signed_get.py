"""The read path's hand-signed GET (``app/tiers/s3/signed_get.py``) against a real S3
endpoint: object keys that need percent-encoding, the answers boto3 would turn into
errors, and retries, through a front that answers S3 errors before passing requests
on to the real endpoint."""

from __future__ import annotations

import http.client
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from app.checksum import crc32c as crc
from app.tiers.s3.client import S3Client
from app.tiers.s3.errors import S3Error, S3Unavailable
from app.tiers.s3.transfers import put_bytes
from tests.s3.conftest import StoreFactory
from tests.s3.harness import S3Endpoint

pytestmark = pytest.mark.anyio

ERROR_CODES = {503: "SlowDown", 403: "AccessDenied"}


def error_document(status: int) -> bytes:
    code = ERROR_CODES[status]
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected by the test</Message></Error>"
    ).encode()


class FaultyFront:
    """An HTTP front for an S3 endpoint: answers the next ``failures`` GETs itself with
    ``status`` and its S3 error document, and forwards every other request unchanged
    (its signature covers the Host header, which is passed on as received)."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        assert parts.hostname is not None and parts.port is not None
        upstream = (parts.hostname, parts.port)
        self.failures = 0
        self.status = 503
        self.gets = 0
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                front.gets += 1
                if front.failures > 0:
                    front.failures -= 1
                    document = error_document(front.status)
                    self.send_response(front.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(document)))
                    self.end_headers()
                    self.wfile.write(document)
                    return
                conn = http.client.HTTPConnection(*upstream, timeout=20)
                try:
                    conn.request("GET", self.path, headers=dict(self.headers.items()))
                    answer = conn.getresponse()
                    data = answer.read()
                finally:
                    conn.close()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("content-length", "connection", "transfer-encoding"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def faulty_front(s3_endpoint: S3Endpoint) -> Iterator[FaultyFront]:
    if not s3_endpoint.endpoint_url.startswith("http://"):
        pytest.skip("the faulty front forwards plain http:// endpoints only")
    front = FaultyFront(s3_endpoint.endpoint_url)
    try:
        yield front
    finally:
        front.close()


async def read(store: S3Client, key: str) -> bytes | None:
    download = await store.open(key)
    if download is None:
        return None
    async with download:
        return await download.read_all()


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
    await put_bytes(store, key, data, crc32c=crc(data))
    download = await store.open(key)
    assert download is not None
    assert (download.info.size, download.info.crc32c) == (len(data), crc(data))
    async with download:
        assert await download.read_all() == data


async def test_what_boto3_reports_as_errors(
    make_store: StoreFactory, s3_endpoint: S3Endpoint
) -> None:
    store = make_store()
    assert await read(store, f"{store.prefix}/absent.safetensors") is None

    missing_bucket = make_store(s3_bucket=f"ec-missing-{uuid.uuid4().hex[:10]}")
    with pytest.raises(S3Error) as caught:
        await read(missing_bucket, f"{store.prefix}/absent.safetensors")
    assert caught.value.code == "NoSuchBucket" and not isinstance(caught.value, S3Unavailable)

    wrong_secret = make_store(secret_access_key="definitely-wrong-secret")
    with pytest.raises(S3Error) as caught:
        await read(wrong_secret, f"{store.prefix}/absent.safetensors")
    assert caught.value.code == "SignatureDoesNotMatch", caught.value
    assert not isinstance(caught.value, S3Unavailable)


async def test_throttling_is_retried_up_to_max_attempts(
    make_store: StoreFactory, faulty_front: FaultyFront
) -> None:
    store = make_store(s3_endpoint_url=faulty_front.url, s3_max_attempts=3)
    key = f"{store.prefix}/retried.safetensors"
    data = b"retried" * 1000
    await put_bytes(make_store(), key, data, crc32c=crc(data))  # the front passes GETs only

    faulty_front.failures, faulty_front.gets = 2, 0
    assert await read(store, key) == data
    assert faulty_front.gets == 3  # two answered SlowDown, the third went through
    assert store.available

    faulty_front.failures, faulty_front.gets = 3, 0
    with pytest.raises(S3Unavailable, match="SlowDown"):
        await read(store, key)
    assert faulty_front.gets == 3
    assert not store.available  # the breaker opened after the last attempt


async def test_a_client_error_is_not_retried(
    make_store: StoreFactory, faulty_front: FaultyFront
) -> None:
    store = make_store(s3_endpoint_url=faulty_front.url, s3_max_attempts=3)
    faulty_front.failures, faulty_front.status, faulty_front.gets = 1, 403, 0
    with pytest.raises(S3Error) as caught:
        await read(store, f"{store.prefix}/forbidden.safetensors")
    assert caught.value.status == 403 and not isinstance(caught.value, S3Unavailable)
    assert faulty_front.gets == 1
