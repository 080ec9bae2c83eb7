"""Namespaces with the S3 tier: listing objects page by page, purge by batched prefix
deletes (under traffic, resumed after a crash), against real servers and SeaweedFS."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from app.namespaces import purge_id
from testkit.entries import body, crc_hex
from testkit.fault_proxy import FaultProxy
from testkit.s3 import S3Endpoint
from testkit.server import ServerProcess
from tests.s3.conftest import ServerFactory


def _put(url: str, model: str, dtype: str, hash_: str, seed: int = 0) -> bytes:
    code, size = {"uint8": ("U8", 1), "float16": ("F16", 2)}[dtype]
    data = body((3, 4), code, size, seed=seed)
    response = httpx.put(
        f"{url}/ec/{model}/{dtype}/{hash_}", content=data, headers={"X-EC-CRC32C": crc_hex(data)}
    )
    assert response.status_code == 201, response.text
    return data


def _seed_objects(endpoint: S3Endpoint, prefix: str, model: str, dtype: str, n: int) -> None:
    """``n`` objects written straight to S3 (faster than through a server)."""
    client = endpoint.client()
    data = body((2,), "U8", 1)

    def one(i: int) -> None:
        key = f"{prefix}/{model}/{dtype}/obj{i:05d}.safetensors"
        client.put_object(Bucket=endpoint.bucket, Key=key, Body=data)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(n)))


def _wait_done(srv: ServerProcess, model: str, timeout: float = 120) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = httpx.get(f"{srv.url}/namespaces/purges", params={"model": model}).json()["purges"]
        if jobs and jobs[0]["state"] == "done":
            return dict(jobs[0])
        time.sleep(0.1)
    raise AssertionError(f"purge of {model} not done after {timeout}s")


def test_s3_listing_pages_and_skips_deeper_models(make_server: ServerFactory) -> None:
    a = make_server("a")
    for i in range(12):
        _put(a.url, "A", "float16", f"h{i:02d}", seed=i)
    # Its key, A/float16/uint8/x.safetensors, lies under A/float16/: must not be listed.
    _put(a.url, "A/float16", "uint8", "x")
    b = make_server("b")  # an empty disk: only S3 knows the entries
    assert httpx.get(b.url + "/namespaces").json()["namespaces"] == []
    hashes, after, pages = [], None, 0
    while True:
        params: dict[str, str | int] = {"model": "A", "dtype": "float16", "tier": "s3", "limit": 5}
        if after:
            params["after"] = after
        page = httpx.get(b.url + "/namespaces/entries", params=params).json()
        pages += 1
        hashes += [e["hash"] for e in page["entries"]]
        assert all(e["tier"] == "s3" and e["shape"] == [3, 4] for e in page["entries"])
        after = page["next"]
        if after is None:
            break
    assert hashes == [f"h{i:02d}" for i in range(12)]
    assert pages == 3


def test_purge_removes_disk_and_s3_under_traffic(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    srv = make_server("a")
    _seed_objects(s3_endpoint, s3_prefix, "Qwen/VL@old", "uint8", 2300)  # 3 batches
    on_disk = [_put(srv.url, "Qwen/VL@old", "float16", f"d{i}", seed=i) for i in range(5)]
    keep = _put(srv.url, "Qwen/VL@new", "float16", "k0")
    _put(srv.url, "Qwen/VL@old/sub", "uint8", "s0")  # another model, deeper: untouched

    failures: list[str] = []
    stop = threading.Event()

    def traffic() -> None:  # another namespace keeps being read and written
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            i = 0
            while not stop.is_set():
                r = client.get("/ec/Qwen/VL@new/float16/k0")
                if r.status_code != 200 or r.content != keep:
                    failures.append(f"GET {r.status_code}")
                data = body((3, 4), "F16", 2, seed=1000 + i)
                r = client.put(f"/ec/Qwen/VL@new/float16/t{i}", content=data)
                if r.status_code != 201:
                    failures.append(f"PUT {r.status_code} {r.text}")
                i += 1

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        response = httpx.post(srv.url + "/namespaces/purge", json={"model": "Qwen/VL@old"})
        assert response.status_code == 202, response.text
        job = _wait_done(srv, "Qwen/VL@old")
    finally:
        stop.set()
        thread.join()
    assert failures == []
    assert job["s3_objects"] == 2300 + 5
    assert job["disk_entries"] == len(on_disk)
    assert s3_endpoint.list_keys(f"{s3_prefix}/Qwen/VL@old/uint8/") == []
    assert s3_endpoint.list_keys(f"{s3_prefix}/Qwen/VL@old/float16/") == []
    assert len(s3_endpoint.list_keys(f"{s3_prefix}/Qwen/VL@old/sub/")) == 1
    assert httpx.get(f"{srv.url}/ec/Qwen/VL@old/float16/d0").status_code == 404
    assert httpx.get(f"{srv.url}/ec/Qwen/VL@old/sub/uint8/s0").status_code == 200
    assert httpx.get(f"{srv.url}/ec/Qwen/VL@new/float16/k0").content == keep


def test_purge_resumes_from_its_cursor_after_a_crash(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    _seed_objects(s3_endpoint, s3_prefix, "old", "uint8", 30)
    srv = make_server("a", start=False)
    journal = srv.data_dir / "purges"
    journal.mkdir(parents=True)
    job_id = purge_id("old", "uint8")
    # As a crash leaves it: 10 objects deleted (we leave them, to see the cursor used).
    record = {
        "id": job_id,
        "model": "old",
        "dtype": "uint8",
        "state": "running",
        "s3_objects": 10,
        "s3_dtype": "uint8",
        "s3_after": f"{s3_prefix}/old/uint8/obj00009.safetensors",
    }
    (journal / f"{job_id}.json").write_text(json.dumps(record))
    srv.start()
    job = _wait_done(srv, "old")
    assert job["s3_objects"] == 30
    left = s3_endpoint.list_keys(f"{s3_prefix}/old/uint8/")
    assert left == [f"{s3_prefix}/old/uint8/obj{i:05d}.safetensors" for i in range(10)]


def test_purge_killed_midway_finishes_after_restart(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    _seed_objects(s3_endpoint, s3_prefix, "old", "uint8", 2100)
    srv = make_server("a")
    assert httpx.post(srv.url + "/namespaces/purge", json={"model": "old"}).status_code == 202
    srv.kill()  # wherever it was: the journal says where to go on
    srv.start()
    job = _wait_done(srv, "old")
    assert job["state"] == "done"
    assert s3_endpoint.list_keys(f"{s3_prefix}/old/") == []


def test_purge_drops_pending_write_back_uploads_and_waits_out_an_outage(
    make_server: ServerFactory,
    s3_proxy: FaultProxy,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
) -> None:
    srv = make_server("a", endpoint_url=s3_proxy.url, write_mode="write-back")
    s3_proxy.down = True  # uploads cannot leave: they wait in the journal
    data = body((3, 4), "F16", 2, seed=3)
    response = httpx.put(f"{srv.url}/ec/wb/float16/pending", content=data)
    assert response.status_code == 201, response.text
    assert httpx.get(srv.url + "/stats").json()["upload_queue"]["entries"] == 1
    assert httpx.post(srv.url + "/namespaces/purge", json={"model": "wb"}).status_code == 202

    def running() -> dict[str, object]:
        (job,) = httpx.get(srv.url + "/namespaces/purges").json()["purges"]
        return dict(job)

    deadline = time.monotonic() + 30
    while running()["last_error"] is None:  # S3 down: the purge retries, says why
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert running()["state"] == "running"
    blocked = httpx.put(f"{srv.url}/ec/wb/float16/new", content=data)
    assert blocked.status_code == 503
    assert blocked.headers["retry-after"] == "5"
    assert httpx.get(f"{srv.url}/ec/wb/float16/pending").status_code == 404

    # Dropped at once, or (when an attempt was running) once that attempt is over: then
    # its object owes a delete (journaled), sent once S3 is back.
    def queue() -> dict[str, int]:
        stats: dict[str, int] = httpx.get(srv.url + "/stats").json()["upload_queue"]
        return stats

    while queue()["entries"] != queue()["deletes"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)

    s3_proxy.down = False
    job = _wait_done(srv, "wb")
    assert job["disk_entries"] == 1
    assert job["last_error"] is None
    assert s3_endpoint.list_keys(f"{s3_prefix}/wb/") == []
    while queue()["entries"] != 0:
        assert time.monotonic() < deadline + 30
        time.sleep(0.1)
    assert httpx.put(f"{srv.url}/ec/wb/float16/new", content=data).status_code == 201
