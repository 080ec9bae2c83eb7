"""One truth across tiers and replicas (issue #45): racing writers on two replicas
sharing one bucket (and on a disk-only server) agree on one body, in S3, on both disks
and in every answer; a GET during a DELETE does not bring the entry back, also after a
restart; a write-back PUT of a key this disk evicted converges on S3's body.

Bodies are compared byte for byte: in S3 (read with boto3, not through the server), in
the disk tiers' files, and in what the servers answer."""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.keys import EntryKey
from testkit.entries import body, crc_hex
from testkit.fault_proxy import FaultProxy
from testkit.polling import wait_for
from testkit.s3 import S3Endpoint
from testkit.server import ServerProcess
from tests.s3.conftest import ServerFactory

MODEL = "truth/m"
WAIT_S = 60  # for the servers and S3, not a timing check
WRITERS = 8


def _path(name: str) -> str:
    return f"/ec/{MODEL}/uint8/{name}"


def _s3_body(endpoint: S3Endpoint, prefix: str, name: str) -> bytes | None:
    client = endpoint.client()
    try:
        answer = client.get_object(
            Bucket=endpoint.bucket, Key=f"{prefix}/{MODEL}/uint8/{name}.safetensors"
        )
    except client.exceptions.NoSuchKey:
        return None
    data: bytes = answer["Body"].read()
    return data


def _disk_bodies(srv: ServerProcess, name: str) -> list[bytes]:
    """The bytes of every committed file of the key in the replica's disk tier."""
    digest = EntryKey(MODEL, "uint8", name).digest
    files = Path(srv.data_dir, "objects").glob(f"*/{digest}.*.safetensors")
    return [path.read_bytes() for path in sorted(files)]


def _holds_only(srv: ServerProcess, name: str, data: bytes) -> bool:
    return _disk_bodies(srv, name) == [data]


def _hidden(url: str, s3_proxy: FaultProxy) -> bool:
    """Whether the replica hides the key (a DELETE of it is under way): a HEAD of it
    is a miss that does not ask S3."""
    asked = s3_proxy.count("HEAD")
    assert httpx.head(url, timeout=WAIT_S).status_code == 404
    return s3_proxy.count("HEAD") == asked


def _queue_empty(srv: ServerProcess) -> bool:
    stats: dict[str, Any] = httpx.get(srv.url + "/stats", timeout=10).json()
    return bool(stats["upload_queue"]["entries"] == 0)


def _lost_uploads(srv: ServerProcess) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    found = re.search(r'^ec_s3_uploads_total\{outcome="lost"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _race(replicas: list[ServerProcess], name: str, bodies: list[bytes]) -> list[httpx.Response]:
    """PUT the bodies at once, alternating replicas; half of them announce their
    CRC32C (the streamed write-through path), half do not (upload after the body); one
    in four sends ``If-None-Match: *``, as the SDK does (412 when it finds the key)."""
    start = threading.Barrier(len(bodies))

    def put(i: int) -> httpx.Response:
        headers = {"X-EC-CRC32C": crc_hex(bodies[i])} if i % 2 else {}
        if i % 4 == 3:
            headers["If-None-Match"] = "*"
        start.wait()
        return httpx.put(
            replicas[i % len(replicas)].url + _path(name),
            content=bodies[i],
            headers=headers,
            timeout=WAIT_S,
        )

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(put, range(len(bodies))))


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_racing_writers_on_two_replicas_agree_on_one_body(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str, mode: str
) -> None:
    replicas = [make_server("a", write_mode=mode), make_server("b", write_mode=mode)]
    bodies = [body((256 * 1024,), "U8", 1, seed=seed) for seed in range(WRITERS)]
    crcs = [crc_hex(data) for data in bodies]
    lost_before = sum(_lost_uploads(srv) for srv in replicas)
    for round_ in range(3):
        name = f"race{round_}"
        answers = _race(replicas, name, bodies)
        assert all(answer.status_code in (200, 201, 412) for answer in answers), [
            (answer.status_code, answer.text) for answer in answers
        ]
        answers = [answer for answer in answers if answer.status_code != 412]
        if mode == "write-back":
            for srv in replicas:
                wait_for(partial(_queue_empty, srv), "the uploads to settle", WAIT_S)
        stored = _s3_body(s3_endpoint, s3_prefix, name)
        assert stored in bodies
        created = [answer for answer in answers if answer.status_code == 201]
        if mode == "write-through":
            # One writer won; every answer describes its body.
            assert len(created) == 1
            assert {answer.json()["crc32c"] for answer in answers} == {crc_hex(stored)}
            assert {answer.headers["x-ec-crc32c"] for answer in answers} == {crc_hex(stored)}
        else:
            # A replica's first writer is answered 201 from its disk; a body that loses
            # in S3 is dropped for S3's (counted), and the next PUT arriving on that
            # replica is taken from disk again, to lose in turn.
            assert {answer.json()["crc32c"] for answer in created} >= {crc_hex(stored)}
            lost_before += sum(answer.json()["crc32c"] != crc_hex(stored) for answer in created)
            assert sum(_lost_uploads(srv) for srv in replicas) == lost_before
        for srv in replicas:
            got = httpx.get(srv.url + _path(name), timeout=WAIT_S)
            assert got.status_code == 200 and got.content == stored
            assert got.headers["x-ec-crc32c"] == crc_hex(stored)
            wait_for(
                partial(_holds_only, srv, name, stored),
                f"{srv.url}'s disk to hold S3's body only",
                WAIT_S,
            )
        assert crc_hex(stored) in crcs


def test_racing_writers_on_a_disk_only_server_agree_on_one_body(tmp_path: Path) -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("EC_")}
    bodies = [body((256 * 1024,), "U8", 1, seed=seed) for seed in range(WRITERS)]
    with ServerProcess(tmp_path / "data", tmp_path / "server.log", env=env) as srv:
        answers = [a for a in _race([srv], "race", bodies) if a.status_code != 412]
        [created] = [answer for answer in answers if answer.status_code == 201]
        [stored] = [data for data in bodies if crc_hex(data) == created.json()["crc32c"]]
        assert {answer.status_code for answer in answers} == {200, 201}
        assert {answer.json()["crc32c"] for answer in answers} == {crc_hex(stored)}
        assert httpx.get(srv.url + _path("race"), timeout=WAIT_S).content == stored
        assert _disk_bodies(srv, "race") == [stored]


def test_a_get_during_a_delete_does_not_bring_the_entry_back(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str, s3_proxy: FaultProxy
) -> None:
    srv = make_server("a", endpoint_url=s3_proxy.url)  # write-through
    data = body((4096,), "U8", 1, seed=3)
    url = srv.url + _path("doomed")
    assert httpx.put(url, content=data, timeout=WAIT_S).status_code == 201
    s3_proxy.delete_gate.clear()  # the S3 delete is held in flight
    with ThreadPoolExecutor(1) as pool:
        deleting = pool.submit(httpx.delete, url, timeout=WAIT_S)
        try:
            wait_for(lambda: s3_proxy.deletes_held == 1, "the S3 delete to be in flight", WAIT_S)
            assert httpx.get(url, timeout=WAIT_S).status_code == 404
            assert httpx.head(url, timeout=WAIT_S).status_code == 404
            exists = httpx.post(srv.url + f"/ec/{MODEL}/uint8/_exists", json={"hashes": ["doomed"]})
            assert exists.json() == {"present": [False]}
            assert _s3_body(s3_endpoint, s3_prefix, "doomed") == data  # still there
        finally:
            s3_proxy.delete_gate.set()
        assert deleting.result().status_code == 204
    assert _s3_body(s3_endpoint, s3_prefix, "doomed") is None
    assert _disk_bodies(srv, "doomed") == []
    assert httpx.get(url, timeout=WAIT_S).status_code == 404
    srv.stop()
    srv.start()
    assert httpx.get(url, timeout=WAIT_S).status_code == 404


def test_a_delete_during_a_write_through_put_leaves_the_tiers_agreeing(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str, s3_proxy: FaultProxy
) -> None:
    """The PUT's upload is held, a DELETE of the key comes, then the upload lands
    before the S3 delete does: the DELETE waits for the PUT's commit, so it removes
    the entry from both tiers, rather than S3 alone (leaving the disk serving it)."""
    srv = make_server("a", endpoint_url=s3_proxy.url)  # write-through
    data = body((4096,), "U8", 1, seed=5)
    url = srv.url + _path("contested")
    s3_proxy.put_gate.clear()
    s3_proxy.delete_gate.clear()
    with ThreadPoolExecutor(2) as pool:
        try:
            putting = pool.submit(httpx.put, url, content=data, timeout=WAIT_S)
            wait_for(lambda: s3_proxy.puts_held == 1, "the upload to be in flight", WAIT_S)
            deleting = pool.submit(httpx.delete, url, timeout=WAIT_S)
            wait_for(partial(_hidden, url, s3_proxy), "the DELETE to be under way", WAIT_S)
            s3_proxy.put_gate.set()
            assert putting.result().status_code == 201
            wait_for(lambda: s3_proxy.deletes_held == 1, "the S3 delete to be in flight", WAIT_S)
        finally:
            s3_proxy.put_gate.set()
            s3_proxy.delete_gate.set()
        assert deleting.result().status_code == 204
    assert _s3_body(s3_endpoint, s3_prefix, "contested") is None
    assert _disk_bodies(srv, "contested") == []
    assert httpx.get(url, timeout=WAIT_S).status_code == 404


def test_a_write_back_put_of_an_evicted_key_converges_on_s3s_body(
    make_server: ServerFactory, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    size = 256 * 1024
    srv = make_server("a", write_mode="write-back", disk_max_bytes=str(2 * size + 4096))
    first, second = body((size,), "U8", 1, seed=10), body((size,), "U8", 1, seed=11)
    url = srv.url + _path("k")
    assert httpx.put(url, content=first, timeout=WAIT_S).status_code == 201
    wait_for(lambda: _queue_empty(srv), "the first upload", WAIT_S)
    for seed, name in enumerate(("filler1", "filler2")):
        filler = body((size,), "U8", 1, seed=20 + seed)
        assert httpx.put(srv.url + _path(name), content=filler, timeout=WAIT_S).status_code == 201
    wait_for(lambda: _disk_bodies(srv, "k") == [], "the entry to be evicted", WAIT_S)

    # S3 has it: a conditional PUT is refused, as everywhere.
    refused = httpx.put(url, content=second, headers={"If-None-Match": "*"}, timeout=WAIT_S)
    assert refused.status_code == 412
    # An unconditional one is taken from disk (write-back), and loses in S3.
    lost_before = _lost_uploads(srv)
    taken = httpx.put(url, content=second, timeout=WAIT_S)
    assert taken.status_code == 201 and taken.json()["crc32c"] == crc_hex(second)
    wait_for(lambda: _queue_empty(srv), "the second upload to settle", WAIT_S)
    assert _lost_uploads(srv) == lost_before + 1
    assert _s3_body(s3_endpoint, s3_prefix, "k") == first
    assert _disk_bodies(srv, "k") in ([], [first])
    got = httpx.get(url, timeout=WAIT_S)
    assert got.status_code == 200 and got.content == first
    wait_for(lambda: _disk_bodies(srv, "k") == [first], "S3's body on disk", WAIT_S)
    srv.stop()
    srv.start()
    assert httpx.get(url, timeout=WAIT_S).content == first
