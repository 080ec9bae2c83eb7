"""Write-through PUT with the S3 upload overlapping the receive (``app.tiers.write_through``),
against the real S3 endpoint: real ``python -m app`` servers, bytes compared.

The contract under test: 201 only once disk and S3 hold the verified bytes; a CRC32C
mismatch or a client that hangs up mid-body leaves nothing in either tier (no object,
no open multipart upload, no temp file); first writer wins.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.entries import crc_hex
from testkit.fault_proxy import FaultProxy
from testkit.polling import wait_for
from testkit.s3 import S3Endpoint
from tests.s3.conftest import MiB, ServerFactory
from tests.s3.test_server_s3 import client_for, entry, metric, put, url

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


def object_key(prefix: str, hash_: str) -> str:
    return f"{prefix}/{MODEL}/float16/{hash_}.safetensors"


def s3_object(endpoint: S3Endpoint, prefix: str, hash_: str) -> bytes | None:
    client = endpoint.client()
    try:
        return bytes(
            client.get_object(Bucket=endpoint.bucket, Key=object_key(prefix, hash_))["Body"].read()
        )
    except client.exceptions.NoSuchKey:
        return None


def open_uploads(endpoint: S3Endpoint, prefix: str) -> list[str]:
    resp = endpoint.client().list_multipart_uploads(Bucket=endpoint.bucket, Prefix=prefix + "/")
    return [item["Key"] for item in resp.get("Uploads", [])]


def temp_files(data_dir: Path) -> list[Path]:
    return list((data_dir / "tmp").glob("put-*"))


def test_streamed_put_stores_the_same_bytes_in_both_tiers(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    srv = make_server("a")
    a = client_for(srv)
    data = entry(2400, seed=3)  # ~4.9 MB, below the multipart threshold: one streamed PUT
    chunks = [data[i : i + 300_000] for i in range(0, len(data), 300_000)]
    resp = a.put(
        url("s1"),
        content=iter(chunks),
        headers={"X-EC-CRC32C": crc_hex(data), "Content-Length": str(len(data))},
    )
    assert resp.status_code == 201, resp.text
    assert s3_object(s3_endpoint, s3_prefix, "s1") == data
    got = a.get(url("s1"))
    assert got.headers["X-EC-Tier"] == "disk" and got.content == data
    assert open_uploads(s3_endpoint, s3_prefix) == []
    assert temp_files(srv.data_dir) == []


def test_upload_starts_before_the_body_is_received(
    make_server: ServerFactory,
    s3_proxy: FaultProxy,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
) -> None:
    """The client holds back the second half of its body until S3 has seen the PUT
    request: with the upload after the receive this would never happen."""
    srv = make_server("a", endpoint_url=s3_proxy.url)
    a = client_for(srv)
    data = entry(2000, seed=4)
    half = len(data) // 2
    s3_proxy.reset()

    def body() -> Iterator[bytes]:
        yield data[:half]
        wait_for(
            lambda: s3_proxy.count("PUT", contains="/s2.safetensors") > 0,
            "S3 to see the PUT while the body is still coming",
            timeout=20,
            interval=0.01,
        )
        yield data[half:]

    resp = a.put(
        url("s2"),
        content=body(),
        headers={"X-EC-CRC32C": crc_hex(data), "Content-Length": str(len(data))},
    )
    assert resp.status_code == 201, resp.text
    assert s3_object(s3_endpoint, s3_prefix, "s2") == data


@pytest.mark.parametrize("size_rows", [2000, 3500])  # streamed; multipart from the file
def test_crc_mismatch_leaves_nothing_anywhere(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str, size_rows: int
) -> None:
    srv = make_server("a", s3_multipart_threshold="5MiB", s3_multipart_part_size="5MiB")
    a = client_for(srv)
    data = entry(size_rows, seed=5)
    assert (len(data) >= 5 * MiB) == (size_rows == 3500)
    wrong = f"{(int(crc_hex(data), 16) ^ 1):08x}"
    resp = a.put(url("bad"), content=data, headers={"X-EC-CRC32C": wrong})
    assert resp.status_code == 400, resp.text
    assert s3_object(s3_endpoint, s3_prefix, "bad") is None
    assert open_uploads(s3_endpoint, s3_prefix) == []
    assert a.get(url("bad")).status_code == 404
    assert temp_files(srv.data_dir) == []
    # Nothing was left behind that would stop the right bytes from being stored.
    assert put(a, "bad", data).status_code == 201
    assert s3_object(s3_endpoint, s3_prefix, "bad") == data


@pytest.mark.parametrize("size_rows", [2000, 3500])
def test_client_gone_mid_body_leaves_nothing_anywhere(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str, size_rows: int
) -> None:
    srv = make_server("a", s3_multipart_threshold="5MiB", s3_multipart_part_size="5MiB")
    a = client_for(srv)
    data = entry(size_rows, seed=6)
    head = (
        f"PUT {url('gone')} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n"
        f"X-EC-CRC32C: {crc_hex(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(head + data[: len(data) * 2 // 3])
        wait_for(lambda: srv.uploads_in_flight() == 1, "the upload to be under way")
    wait_for(lambda: temp_files(srv.data_dir) == [], "the temp file to go", 10)
    assert s3_object(s3_endpoint, s3_prefix, "gone") is None
    assert open_uploads(s3_endpoint, s3_prefix) == []
    assert a.get(url("gone")).status_code == 404
    assert put(a, "gone", data).status_code == 201
    assert s3_object(s3_endpoint, s3_prefix, "gone") == data
    # The withdrawal was not taken for an S3 outage (breaker left closed).
    assert metric(a, "ec_s3_requests_total", operation="put", result="unavailable") == 0
    assert metric(a, "ec_s3_fast_failures_total") == 0


def test_first_writer_wins_across_replicas(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    first, second = entry(1500, seed=7), entry(1500, seed=8)
    a = client_for(make_server("a"))
    b = client_for(make_server("b"))
    assert put(a, "fw", first).status_code == 201
    # Replica b has nothing on disk; without If-None-Match it asks S3 itself.
    resp = put(b, "fw", second)
    assert resp.status_code == 200, resp.text
    assert resp.json()["crc32c"] == crc_hex(first)
    assert s3_object(s3_endpoint, s3_prefix, "fw") == first
    with httpx.Client(base_url=a.base_url) as again:  # and with If-None-Match: 412
        resp = again.put(
            url("fw"),
            content=second,
            headers={"X-EC-CRC32C": crc_hex(second), "If-None-Match": "*"},
        )
    assert resp.status_code == 412
