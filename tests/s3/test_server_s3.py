"""The server with its S3 tier: real ``python -m app`` processes against a real S3.

Runs against the managed SeaweedFS or any ``EC_TEST_S3_*`` endpoint. Outages are played
either by stopping SeaweedFS (managed only) or by cutting the counting proxy between the
server and S3 (any plain-http endpoint).
"""

from __future__ import annotations

import base64
import re
import threading
import uuid

import httpx

from app.tiers.s3.signing import USER_AGENT
from testkit.entries import body, crc_hex
from testkit.fault_proxy import FaultProxy
from testkit.polling import wait_for
from testkit.ports import free_ports
from testkit.s3 import S3Endpoint
from testkit.server import ServerProcess
from tests.s3.conftest import MiB, S3Control, ServerFactory

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


def entry(rows: int, seed: int = 0, cols: int = 1024) -> bytes:
    """A float16 safetensors body of about ``rows * cols * 2`` bytes."""
    return body((rows, cols), "F16", 2, seed=seed)


def url(hash_: str, model: str = MODEL) -> str:
    return f"/ec/{model}/float16/{hash_}"


def put(client: httpx.Client, hash_: str, data: bytes) -> httpx.Response:
    return client.put(url(hash_), content=data, headers={"X-EC-CRC32C": crc_hex(data)})


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    """One sample from /metrics (0 when absent)."""
    text = client.get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if match is None or match.group(1) != name:
            continue
        found = match.group(2) or ""
        items = sorted(re.findall(r'(\w+)="([^"]*)"', found))
        if ",".join(f'{k}="{v}"' for k, v in items) == want:
            return float(match.group(3))
    return 0.0


def client_for(srv: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=srv.url, timeout=60)


# ------------------------------------------------------------------ round trips


def test_write_through_round_trip_and_second_replica(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    a = client_for(make_server("a"))
    data = entry(600, seed=1)  # ~1.2 MB
    resp = put(a, "h1", data)
    assert resp.status_code == 201, resp.text
    assert put(a, "h1", data).status_code == 200  # first writer wins

    # In S3 under a human-readable key, CRC32C in the object metadata.
    key = f"{s3_prefix}/{MODEL}/float16/h1.safetensors"
    assert s3_endpoint.list_keys(s3_prefix + "/") == [key]
    head = s3_endpoint.client().head_object(Bucket=s3_endpoint.bucket, Key=key)
    assert head["Metadata"]["ec-crc32c"] == crc_hex(data)
    assert head["Metadata"]["ec-shape"] == "600,1024"

    got = a.get(url("h1"))
    assert got.status_code == 200 and got.content == data
    assert got.headers["X-EC-Tier"] == "disk"

    # A second replica with its own (empty) disk reads what the first wrote.
    b = client_for(make_server("b"))
    got = b.get(url("h1"))
    assert got.status_code == 200, got.text
    assert got.content == data
    assert got.headers["X-EC-Tier"] == "s3"
    assert got.headers["X-EC-CRC32C"] == crc_hex(data)
    assert got.headers["X-EC-Shape"] == "600,1024"
    assert got.headers["Content-Length"] == str(len(data))
    # ... and has filled its disk tier with it (the commit may trail the last byte).
    wait_for(lambda: b.get(url("h1")).headers["X-EC-Tier"] == "disk", "the disk fill", 10)
    again = b.get(url("h1"))
    assert again.headers["X-EC-Tier"] == "disk" and again.content == data
    assert b.get(url("nope")).status_code == 404
    assert b.post(f"/ec/{MODEL}/float16/_exists", json={"hashes": ["h1", "nope"]}).json() == {
        "present": [True, False]
    }
    # The second replica sees the entry as present: PUT answers 200, stores nothing new.
    assert put(b, "h1", data).status_code == 200
    assert b.put(url("h1"), content=data, headers={"If-None-Match": "*"}).status_code == 412


def test_disk_copies_of_s3_entries_are_not_synced(make_server: ServerFactory) -> None:
    """A write-through PUT's disk copy (committed once S3 has the entry) and a
    read-through fill are published without fdatasync or directory fsync: S3 holds the
    entry, a copy lost to a power cut is fetched again. A write-back PUT, whose entry is
    only on this disk until uploaded, syncs its file and its journal record."""
    fsyncs = "ec_disk_commit_fsyncs_total"
    a = client_for(make_server("a"))
    assert put(a, "wt", entry(300, seed=3)).status_code == 201
    assert metric(a, fsyncs, kind="file") == 0

    b = client_for(make_server("b"))
    assert b.get(url("wt")).headers["X-EC-Tier"] == "s3"
    wait_for(lambda: b.get(url("wt")).headers["X-EC-Tier"] == "disk", "the disk fill", 10)
    assert metric(b, fsyncs, kind="file") == 0

    c = client_for(make_server("c", write_mode="write-back"))
    assert put(c, "wb", entry(300, seed=4)).status_code == 201
    assert metric(c, fsyncs, kind="file") == 2  # the entry and its upload record
    assert metric(c, fsyncs, kind="directory") >= 2  # upload-queue/, the entry's shard


def test_head_on_disk_miss_never_downloads(
    make_server: ServerFactory, s3_proxy: FaultProxy
) -> None:
    a = client_for(make_server("a"))
    data = entry(3000, seed=2)  # ~6 MB
    assert put(a, "h2", data).status_code == 201
    b = client_for(make_server("b", endpoint_url=s3_proxy.url))
    s3_proxy.reset()
    resp = b.head(url("h2"))
    assert resp.status_code == 200
    assert resp.headers["X-EC-Tier"] == "s3"
    assert resp.headers["Content-Length"] == str(len(data))
    assert resp.headers["X-EC-CRC32C"] == crc_hex(data)
    assert resp.headers["X-EC-Shape"] == "3000,1024"
    assert resp.headers["ETag"] == f'"{crc_hex(data)}"'
    assert s3_proxy.count("HEAD", "h2") == 1
    assert s3_proxy.count("GET", "h2") == 0
    assert b.head(url("absent")).status_code == 404


def test_objects_written_by_other_tools(
    make_server: ServerFactory,
    s3_proxy: FaultProxy,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
) -> None:
    """Objects without ec-* metadata (e.g. copied in with `aws s3 cp`) still work."""
    client = s3_endpoint.client()
    with_crc = entry(700, seed=14)
    without = entry(700, seed=15)
    base = f"{s3_prefix}/{MODEL}/float16"
    client.put_object(
        Bucket=s3_endpoint.bucket,
        Key=f"{base}/foreign-crc.safetensors",
        Body=with_crc,
        ChecksumAlgorithm="CRC32C",
        ChecksumCRC32C=base64.b64encode(int(crc_hex(with_crc), 16).to_bytes(4, "big")).decode(),
    )
    client.put_object(
        Bucket=s3_endpoint.bucket, Key=f"{base}/foreign-plain.safetensors", Body=without
    )
    b = client_for(make_server("b", endpoint_url=s3_proxy.url))

    # An S3 CRC32C but no ec-* metadata: HEAD reads only the safetensors header.
    s3_proxy.reset()
    resp = b.head(url("foreign-crc"))
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-EC-CRC32C"] == crc_hex(with_crc)
    assert resp.headers["X-EC-Shape"] == "700,1024"
    assert resp.headers["X-EC-Tier"] == "s3"
    ranged = [p for m, p in s3_proxy.snapshot() if m == "GET"]
    assert len(ranged) == 1  # the header, by a ranged GET (checked: not the whole body)
    assert s3_proxy.headers_of("GET")[0]["User-Agent"] == USER_AGENT  # the data plane's
    assert int(metric(b, "ec_s3_bytes_total", direction="down")) < 70_000
    got = b.get(url("foreign-crc"))
    assert got.content == with_crc and got.headers["X-EC-CRC32C"] == crc_hex(with_crc)

    # No checksum at all: the CRC32C is only known after a full read through the disk.
    resp = b.head(url("foreign-plain"))
    assert resp.status_code == 200 and resp.headers["X-EC-CRC32C"] == crc_hex(without)
    got = b.get(url("foreign-plain"))
    assert got.headers["X-EC-Tier"] == "disk" and got.content == without


def test_disk_eviction_then_reread_from_s3(make_server: ServerFactory) -> None:
    a = client_for(make_server("a", disk_max_bytes="3MiB"))
    bodies = {f"e{i}": entry(500, seed=10 + i) for i in range(4)}  # ~1 MB each
    for name, data in bodies.items():
        assert put(a, name, data).status_code == 201
    stats = a.get("/stats").json()
    assert stats["disk"]["evictions"] >= 1
    # The oldest was evicted from disk; it comes back from S3, byte for byte.
    got = a.get(url("e0"))
    assert got.status_code == 200 and got.content == bodies["e0"]
    assert got.headers["X-EC-Tier"] == "s3"
    for name, data in bodies.items():
        assert a.get(url(name)).content == data


def test_delete_removes_from_both_tiers(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    a = client_for(make_server("a"))
    data = entry(100, seed=3)
    assert put(a, "gone", data).status_code == 201
    assert a.delete(url("gone")).status_code == 204
    assert s3_endpoint.list_keys(s3_prefix + "/") == []
    assert a.get(url("gone")).status_code == 404
    assert a.head(url("gone")).status_code == 404


def test_large_entry_goes_up_as_multipart(make_server: ServerFactory, s3_proxy: FaultProxy) -> None:
    a = client_for(
        make_server(
            "a",
            endpoint_url=s3_proxy.url,
            s3_multipart_threshold="8MiB",
            s3_multipart_part_size="5MiB",
        )
    )
    data = entry(10_000, seed=4)  # ~20 MB: 4 parts
    assert put(a, "big", data).status_code == 201
    parts = [
        p
        for m, p in s3_proxy.snapshot()
        if m == "PUT" and "partNumber=" in p and "/big.safetensors" in p
    ]
    assert len(parts) == 4
    b = client_for(make_server("b"))
    got = b.get(url("big"))
    assert got.headers["X-EC-CRC32C"] == crc_hex(data) and got.content == data


# ------------------------------------------------------------------ single-flight


def test_concurrent_misses_make_one_s3_request(
    make_server: ServerFactory, s3_proxy: FaultProxy
) -> None:
    a = client_for(make_server("a"))
    data = entry(15_000, seed=5)  # ~30 MB
    assert put(a, "sf", data).status_code == 201

    srv = make_server(
        "b", endpoint_url=s3_proxy.url, s3_get_chunk_size="1MiB", s3_get_part_size="8MiB"
    )
    s3_proxy.reset()
    n = 8
    barrier = threading.Barrier(n)
    results: list[tuple[int, str, bytes] | BaseException] = []
    lock = threading.Lock()

    def fetch() -> None:
        try:
            with client_for(srv) as client:
                barrier.wait()
                resp = client.get(url("sf"))
                out: tuple[int, str, bytes] | BaseException = (
                    resp.status_code,
                    resp.headers.get("X-EC-Tier", ""),
                    resp.content,
                )
        except BaseException as exc:
            out = exc
        with lock:
            results.append(out)

    threads = [threading.Thread(target=fetch) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == n
    for result in results:
        assert not isinstance(result, BaseException), result
        status, _, content = result
        assert status == 200 and content == data
    # One read of the object: its ranged GETs, one per 8 MiB part.
    parts = -(-len(data) // (8 * MiB))
    assert s3_proxy.count("GET", "/sf.safetensors") == parts, s3_proxy.snapshot()
    b = client_for(srv)
    joins = metric(b, "ec_s3_singleflight_joins_total")
    from_s3 = sum(1 for r in results if not isinstance(r, BaseException) and r[1] == "s3")
    assert joins == from_s3 - 1 and joins >= 1


def test_slow_client_does_not_hold_the_fill_and_a_vanished_one_stops_it(
    make_server: ServerFactory, s3_proxy: FaultProxy
) -> None:
    a = client_for(make_server("a"))
    data = entry(10_000, seed=12)  # ~20 MB
    assert put(a, "slow", data).status_code == 201
    b_srv = make_server("b", endpoint_url=s3_proxy.url, s3_get_chunk_size="1MiB")
    b = client_for(b_srv)
    with b.stream("GET", url("slow")) as resp:
        assert resp.headers["X-EC-Tier"] == "s3"
        chunks = resp.iter_raw(64 * 1024)
        first = next(chunks)
        # The reader stalls; the S3 -> disk copy goes on and commits without it.
        wait_for(
            lambda: metric(b, "ec_s3_fills_total", outcome="committed") == 1,
            "the fill to commit while its first reader stalls",
            20,
        )
        rest = b"".join(chunks)
    assert first + rest == data
    assert b.get(url("slow")).headers["X-EC-Tier"] == "disk"

    # The only client leaves mid-body: the fill stops (nothing kept); the next GET
    # reads S3 again (tests/s3/test_ranged_get.py: its part GETs stop too).
    other = entry(10_000, seed=13)
    assert put(a, "left", other).status_code == 201
    with b.stream("GET", url("left")) as resp:
        next(resp.iter_raw(64 * 1024))
    b.close()  # drops the connection with most of the body unread
    b = client_for(b_srv)
    wait_for(
        lambda: metric(b, "ec_s3_fills_total", outcome="abandoned") == 1,
        "the fill to stop after its only reader left",
        20,
    )
    got = b.get(url("left"))
    assert got.headers["X-EC-Tier"] == "s3" and got.content == other
    wait_for(lambda: b.get(url("left")).headers["X-EC-Tier"] == "disk", "the second fill", 20)


# ------------------------------------------------------------------ write-back


def test_write_back_upload_survives_kill_9(
    make_server: ServerFactory,
    s3_proxy: FaultProxy,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
) -> None:
    s3_proxy.down = True  # S3 unreachable: uploads must wait in the queue
    srv = make_server("a", endpoint_url=s3_proxy.url, write_mode="write-back")
    a = client_for(srv)
    data = entry(800, seed=6)
    assert put(a, "wb", data).status_code == 201  # on disk only
    assert a.get(url("wb")).content == data
    journal = srv.data_dir / "upload-queue"
    assert len(list(journal.glob("*.json"))) == 1
    assert metric(a, "ec_s3_upload_queue_depth") == 1
    assert s3_endpoint.list_keys(s3_prefix + "/") == []

    srv.kill()  # SIGKILL: nothing gets a chance to flush
    s3_proxy.down = False
    srv.start()
    key = f"{s3_prefix}/{MODEL}/float16/wb.safetensors"
    wait_for(lambda: s3_endpoint.list_keys(s3_prefix + "/") == [key], "the upload", 20)
    wait_for(lambda: not list(journal.glob("*.json")), "the journal to empty", 10)
    assert metric(a, "ec_s3_upload_queue_depth") == 0
    # The object is complete and checked: a fresh replica serves it.
    got = client_for(make_server("b")).get(url("wb"))
    assert got.headers["X-EC-Tier"] == "s3" and got.content == data


def test_write_back_drains_at_shutdown(
    make_server: ServerFactory,
    s3_proxy: FaultProxy,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
) -> None:
    s3_proxy.down = True
    # The failed upload's next retry is far off, so only the drain can send it.
    srv = make_server(
        "a",
        endpoint_url=s3_proxy.url,
        write_mode="write-back",
        writeback_retry_min="60",
        writeback_retry_max="60",
        s3_unavailable_cooldown="0.1",
    )
    a = client_for(srv)
    data = entry(300, seed=16)
    assert put(a, "drain", data).status_code == 201
    assert metric(a, "ec_s3_upload_queue_depth") == 1
    assert metric(a, "ec_s3_upload_queue_oldest_seconds") > 0
    wait_for(
        lambda: metric(a, "ec_s3_uploads_total", outcome="retry") >= 1,
        "the first upload attempt to fail",
        30,
    )
    s3_proxy.down = False
    # S3 reachable again as the server sees it, or the drain's attempt fails fast.
    wait_for(lambda: a.get("/readyz").status_code == 200, "the server to reach S3 again")
    srv.stop()  # SIGTERM: the pending upload gets EC_WRITEBACK_DRAIN_TIMEOUT to finish
    assert s3_endpoint.list_keys(s3_prefix + "/") == [
        f"{s3_prefix}/{MODEL}/float16/drain.safetensors"
    ]
    assert not list((srv.data_dir / "upload-queue").glob("*.json"))
    assert "draining 1 pending uploads" in srv.log_path.read_text()


def test_write_back_queue_bound_never_drops(
    make_server: ServerFactory, s3_proxy: FaultProxy, s3_endpoint: S3Endpoint
) -> None:
    s3_proxy.down = True
    a = client_for(
        make_server(
            "a",
            endpoint_url=s3_proxy.url,
            write_mode="write-back",
            writeback_queue_max_entries="2",
            writeback_queue_max_bytes="10MiB",
            disk_max_bytes="1MiB",
        )
    )
    bodies = [entry(300, seed=20 + i) for i in range(3)]  # ~600 KB each
    assert put(a, "q0", bodies[0]).status_code == 201
    assert put(a, "q1", bodies[1]).status_code == 201
    # Queue full and S3 down: falls back to write-through, which cannot succeed.
    resp = put(a, "q2", bodies[2])
    assert resp.status_code == 503 and "Retry-After" in resp.headers
    assert metric(a, "ec_s3_upload_queue_full_total") == 1
    assert a.get(url("q2")).status_code == 503  # unknown, not absent: S3 is down
    # Two pending entries exceed the 1 MiB disk bound, yet neither was evicted: pinned.
    assert a.get("/stats").json()["disk"]["evictions"] == 0
    for i in range(2):
        got = a.get(url(f"q{i}"))
        assert got.headers["X-EC-Tier"] == "disk" and got.content == bodies[i]

    s3_proxy.down = False
    wait_for(lambda: metric(a, "ec_s3_upload_queue_depth") == 0, "the queue to drain", 20)
    assert metric(a, "ec_s3_uploads_total", outcome="ok") == 2
    assert a.get("/stats").json()["disk"]["evictions"] >= 1  # unpinned: bound applies
    assert put(a, "q2", bodies[2]).status_code == 201
    for i in range(3):
        assert a.get(url(f"q{i}")).content == bodies[i]


# ------------------------------------------------------------------ outages


def test_s3_stopped_then_restarted(
    make_server: ServerFactory, s3_control: S3Control, s3_endpoint: S3Endpoint
) -> None:
    a = client_for(make_server("a"))
    data = entry(200, seed=7)
    assert put(a, "here", data).status_code == 201
    assert a.get("/readyz").status_code == 200

    s3_control.stop()
    got = a.get(url("here"))
    assert got.status_code == 200 and got.content == data  # disk hit still served
    miss = a.get(url("elsewhere"))
    assert miss.status_code == 503, miss.text
    assert miss.json()["error"] == "unavailable"
    assert int(miss.headers["Retry-After"]) >= 1
    assert a.head(url("elsewhere")).status_code == 503
    resp = put(a, "new", entry(100, seed=8))
    assert resp.status_code == 503  # write-through: no 201 without S3
    ready = a.get("/readyz")
    assert ready.status_code == 503 and "unreachable" in ready.json()["checks"]["s3"]
    exists = a.post(f"/ec/{MODEL}/float16/_exists", json={"hashes": ["here"]})
    assert exists.json() == {"present": [True]}  # answered by disk alone
    exists = a.post(f"/ec/{MODEL}/float16/_exists", json={"hashes": ["here", "elsewhere"]})
    assert exists.status_code == 503
    assert a.delete(url("here")).status_code == 503  # S3 copy could not be removed

    s3_control.start()
    wait_for(lambda: a.get("/readyz").status_code == 200, "readiness to recover", 20)
    assert a.get(url("elsewhere")).status_code == 404  # recovered, no restart
    assert a.get(url("here")).content == data  # the disk copy went, S3 still had it
    assert a.delete(url("here")).status_code == 204
    assert a.get(url("here")).status_code == 404
    assert put(a, "new", entry(100, seed=8)).status_code == 201


def test_put_during_outage_leaves_nothing(
    make_server: ServerFactory,
    s3_proxy: FaultProxy,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
) -> None:
    srv = make_server(
        "a",
        endpoint_url=s3_proxy.url,
        s3_multipart_threshold="5MiB",
        s3_multipart_part_size="5MiB",
    )
    a = client_for(srv)
    s3_proxy.down = True
    resp = put(a, "partial", entry(5000, seed=9))  # ~10 MB: would be multipart
    assert resp.status_code == 503
    s3_proxy.down = False
    assert s3_endpoint.list_keys(s3_prefix + "/") == []
    assert list((srv.data_dir / "objects").rglob("*.safetensors")) == []
    wait_for(lambda: a.get(url("partial")).status_code == 404, "S3 to be reachable", 10)


def test_corrupt_object_in_s3_is_not_served_whole_nor_cached(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    data = entry(400, seed=11)
    key = f"{s3_prefix}/{MODEL}/float16/bad.safetensors"
    wrong = f"{(int(crc_hex(data), 16) ^ 1):08x}"
    s3_endpoint.client().put_object(
        Bucket=s3_endpoint.bucket, Key=key, Body=data, Metadata={"ec-crc32c": wrong}
    )
    srv = make_server("a")
    for _ in range(2):  # not cached: the second read goes to S3 again, and fails again
        with client_for(srv) as a:
            try:
                resp = a.get(url("bad"))
            except httpx.RemoteProtocolError:
                pass  # headers went out, then the connection was cut before the last byte
            else:
                assert resp.status_code == 502, resp.status_code
    assert list((srv.data_dir / "objects").rglob("*.safetensors")) == []
    assert metric(client_for(srv), "ec_s3_fills_total", outcome="failed") == 2


# ------------------------------------------------------------------ configuration


def test_wrong_credentials_are_reported(make_server: ServerFactory) -> None:
    srv = make_server("a", env={"AWS_SECRET_ACCESS_KEY": "wrong-secret-" + uuid.uuid4().hex})
    a = client_for(srv)
    ready = a.get("/readyz")
    assert ready.status_code == 503
    reason = ready.json()["checks"]["s3"]
    assert reason.startswith("credentials:") and "wrong S3 credentials" in reason
    log = srv.log_path.read_text()
    assert "S3 tier NOT READY (credentials)" in log
    assert "other reads answer 502 s3_error until this is fixed" in log
    resp = a.get(url("x"))
    assert resp.status_code == 502 and resp.json()["error"] == "s3_error"


def test_unreachable_endpoint_at_start_up_is_reported(make_server: ServerFactory) -> None:
    (closed,) = free_ports(1)  # nothing listens there: every connection is refused
    srv = make_server("a", endpoint_url=f"http://127.0.0.1:{closed}")
    log = srv.log_path.read_text()
    assert "S3 tier NOT READY (unreachable)" in log
    assert "other reads answer 503 unavailable until this is fixed" in log
    resp = client_for(srv).get(url("x"))
    assert resp.status_code == 503 and resp.json()["error"] == "unavailable"


def test_missing_bucket_is_reported_or_created(
    make_server: ServerFactory, s3_endpoint: S3Endpoint
) -> None:
    name = f"ec-missing-{uuid.uuid4().hex[:8]}"
    srv = make_server("a", s3_bucket=name)
    ready = client_for(srv).get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["checks"]["s3"].startswith("no_bucket:")
    assert "EC_S3_CREATE_BUCKET" in ready.json()["checks"]["s3"]
    assert "S3 tier NOT READY (no_bucket)" in srv.log_path.read_text()

    creating = make_server("b", s3_bucket=name, s3_create_bucket="true")
    try:
        assert client_for(creating).get("/readyz").status_code == 200
    finally:
        creating.stop()
        s3_endpoint.client().delete_bucket(Bucket=name)
