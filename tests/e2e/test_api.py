"""The HTTP API against a real server process, driven over real sockets."""

from __future__ import annotations

import concurrent.futures
import random
import select
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load, save

from app import __version__
from testkit.entries import body, crc_hex
from testkit.polling import wait_for
from testkit.server import ServerProcess
from tests.e2e import rawhttp

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
JSON = {"Content-Type": "application/json"}


def entry_url(hash: str, dtype: str = "bfloat16", model: str = MODEL) -> str:
    return f"/ec/{model}/{dtype}/{hash}"


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def assert_nothing_left(server: ServerProcess, hash_prefix: str = "") -> None:
    """No temp file remains (a disconnect is noticed asynchronously) and the server
    still answers."""
    wait_for(lambda: files_under(server.data_dir / "tmp") == [], "the temp files to go", 5)
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_round_trip_headers_and_first_writer_wins(client: httpx.Client) -> None:
    tensor = torch.randn(576, 64).to(torch.bfloat16)
    data = save({"embedding": tensor})
    created = client.put(entry_url("rt1"), content=data, headers={"X-EC-CRC32C": crc_hex(data)})
    assert created.status_code == 201
    assert created.json() == {"created": True, "size": len(data), "crc32c": crc_hex(data)}

    other = save({"embedding": torch.zeros(576, 64, dtype=torch.bfloat16)})
    again = client.put(entry_url("rt1"), content=other)
    assert again.status_code == 200
    assert again.json()["created"] is False

    got = client.get(entry_url("rt1"))
    assert got.status_code == 200
    assert got.content == data
    assert torch.equal(load(got.content)["embedding"], tensor)
    assert got.headers["content-type"] == "application/octet-stream"
    assert got.headers["etag"] == f'"{crc_hex(data)}"'
    assert got.headers["x-ec-crc32c"] == crc_hex(data)
    assert got.headers["x-ec-dtype"] == "bfloat16"
    assert got.headers["x-ec-shape"] == "576,64"
    assert got.headers["x-ec-tier"] == "disk"
    assert int(got.headers["x-ec-data-offset"]) == len(data) - tensor.numel() * 2

    head = client.head(entry_url("rt1"))
    assert head.status_code == 200
    assert head.content == b""
    assert head.headers["content-length"] == str(len(data))
    assert head.headers["x-ec-shape"] == "576,64"

    assert (
        client.get(entry_url("rt1"), headers={"If-None-Match": got.headers["etag"]}).status_code
        == 304
    )


def test_encoded_slash_names_the_same_model(client: httpx.Client, server: ServerProcess) -> None:
    data = body((8,), "BF16", 2)
    assert client.put(entry_url("slash"), content=data).status_code == 201
    encoded = rawhttp.request(
        server.port, "GET", "/ec/Qwen%2FQwen2.5-VL-7B-Instruct/bfloat16/slash"
    )
    assert encoded.status == 200
    assert encoded.body == data


def test_missing_entry(client: httpx.Client) -> None:
    for method in ("GET", "HEAD"):
        response = client.request(method, entry_url("absent"))
        assert response.status_code == 404
    assert client.get(entry_url("absent")).json()["error"] == "not_found"
    assert client.delete(entry_url("absent")).status_code == 204


def test_delete(client: httpx.Client) -> None:
    data = body((8,), "BF16", 2)
    client.put(entry_url("del"), content=data)
    assert client.delete(entry_url("del")).status_code == 204
    assert client.get(entry_url("del")).status_code == 404
    assert client.put(entry_url("del"), content=data).status_code == 201


HOSTILE_TARGETS = [
    ("/ec/../../etc/passwd/float32/x", 400, "model"),
    ("/ec/a/%2e%2e/%2e%2e/float32/x", 400, "model"),
    ("/ec/a/..%2f..%2f..%2fetc/float32/x", 400, "model"),
    ("/ec//etc/float32/x", 400, "model"),
    ("/ec/%2Fetc/float32/x", 400, "model"),
    ("/ec/a%00b/float32/x", 400, "model"),
    ("/ec/a/float32/x%00y", 400, "hash"),
    ("/ec/a/float32/" + "h" * 257, 400, "hash"),
    ("/ec/" + "m" * 257 + "/float32/x", 400, "model"),
    ("/ec/a/float32/x%2F..%2F..%2Fy", 400, "model"),
    ("/ec/a/torch.float32/x", 400, "dtype"),
    ("/ec/a/float32/x%20y", 400, "hash"),
    ("/ec/a/./float32/x", 400, "model"),
    ("/ec/float32/x", 404, None),
    ("/etc/passwd", 404, None),
    ("/../../etc/passwd", 404, None),
]


@pytest.mark.parametrize(("target", "status", "part"), HOSTILE_TARGETS)
def test_hostile_paths_are_rejected(
    server: ServerProcess, target: str, status: int, part: str | None
) -> None:
    data = body((4,), "F32", 4)
    before = files_under(server.data_dir)
    for method in ("PUT", "GET", "HEAD"):
        response = rawhttp.request(
            server.port, method, target, body=data if method == "PUT" else b""
        )
        assert response.status == status, (method, target, response.body)
        if method != "HEAD":
            error = response.json()
            assert error["part"] == part
            assert error["message"]
    assert files_under(server.data_dir) == before


BAD_BODIES = [
    ("bad_dtype", "/ec/m/float/x", body(), 400, "invalid_dtype"),
    ("dtype_mismatch", "/ec/m/float16/x", body(code="BF16", itemsize=2), 400, "dtype_mismatch"),
    (
        "shape_mismatch",
        "/ec/m/float32/x",
        body(header={"t": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 64]}}),
        400,
        "invalid_body",
    ),
    ("short_data", "/ec/m/float32/x", body()[:-4], 400, "invalid_body"),
    (
        "malformed_header",
        "/ec/m/float32/x",
        b"\x10" + b"\0" * 7 + b"{not json at all",
        400,
        "invalid_body",
    ),
    ("huge_header", "/ec/m/float32/x", b"\xff" * 8 + b"{}", 400, "invalid_body"),
    (
        "two_tensors",
        "/ec/m/float32/x",
        save({"a": torch.ones(2), "b": torch.ones(2)}),
        400,
        "invalid_body",
    ),
    ("empty", "/ec/m/float32/x", b"", 400, "invalid_body"),
]


@pytest.mark.parametrize(
    ("target", "data", "status", "code"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
def test_bad_bodies_are_rejected_and_leave_nothing(
    server: ServerProcess, target: str, data: bytes, status: int, code: str
) -> None:
    response = rawhttp.request(server.port, "PUT", target, body=data)
    assert response.status == status
    assert response.json()["error"] == code
    assert rawhttp.request(server.port, "GET", target).status in (400, 404)
    assert_nothing_left(server)


def test_wrong_checksum(server: ServerProcess, client: httpx.Client) -> None:
    data = body()
    wrong = f"{int(crc_hex(data), 16) ^ 1:08x}"
    response = client.put(entry_url("crc", "float32"), content=data, headers={"X-EC-CRC32C": wrong})
    assert response.status_code == 400
    assert response.json()["error"] == "checksum_mismatch"
    response = client.put(entry_url("crc", "float32"), content=data, headers={"X-EC-CRC32C": "xyz"})
    assert response.status_code == 400
    assert response.json()["part"] == "checksum"
    assert client.get(entry_url("crc", "float32")).status_code == 404
    assert_nothing_left(server)


@pytest.mark.parametrize(
    "data",
    [b"an embedding, as text: 0.1 0.2 0.3\n" * 4, b"\x93NUMPY\x01\x00v\x00" + b" " * 120],
    ids=["text", "npy"],
)
def test_a_body_that_is_no_safetensors_file_says_so(client: httpx.Client, data: bytes) -> None:
    """Its first 8 bytes read as a huge header length, or its header is not JSON: the
    answer says what the body is not and how to send a file, not a 15-digit number."""
    answer = client.put(entry_url("not-safetensors", "float32"), content=data)
    assert answer.status_code == 400
    message = answer.json()["message"]
    assert message.startswith(
        "not a safetensors file; send the file as it is, e.g. curl --data-binary @FILE ("
    ), message
    assert client.head(entry_url("not-safetensors", "float32")).status_code == 404


def test_body_over_the_maximum(server: ServerProcess) -> None:
    # The module's server accepts at most 64 MiB.
    huge = 65 * 1024 * 1024
    response = rawhttp.request(
        server.port, "PUT", "/ec/m/uint8/big", {"Content-Length": str(huge)}, send_body=False
    )
    assert response.status == 413
    assert response.json()["error"] == "body_too_large"
    assert response.headers.get("connection") == "close"

    # Chunked, so no Content-Length: the header's declared size gives it away.
    data = body((huge,), "U8", 1)
    with httpx.Client(base_url=server.url) as http:
        chunked = http.put(
            "/ec/m/uint8/big",
            content=iter([data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20)]),
        )
    assert chunked.status_code == 413
    assert_nothing_left(server)


def test_truncated_body_and_disconnect_leave_nothing(server: ServerProcess) -> None:
    data = body((1 << 20,), "U8", 1)
    rawhttp.send_partial(server.port, "/ec/m/uint8/cut", len(data), data[: len(data) // 2])
    rawhttp.send_partial(server.port, "/ec/m/uint8/cut", len(data), data[:5])
    assert_nothing_left(server)
    assert rawhttp.request(server.port, "GET", "/ec/m/uint8/cut").status == 404


def test_if_none_match_answers_without_reading_the_body(server: ServerProcess) -> None:
    data = body((1 << 20,), "U8", 1)
    assert rawhttp.request(server.port, "PUT", "/ec/m/uint8/inm", body=data).status == 201
    # Expect: 100-continue and no body sent: the answer must come anyway.
    started = time.monotonic()
    response = rawhttp.request(
        server.port,
        "PUT",
        "/ec/m/uint8/inm",
        {"Content-Length": str(len(data)), "If-None-Match": "*", "Expect": "100-continue"},
        send_body=False,
        timeout=5,
    )
    assert response.status == 412
    assert response.json()["error"] == "already_exists"
    assert time.monotonic() - started < 5  # it did not wait for a body that never came
    # Absent key: If-None-Match: * stores normally.
    fresh = rawhttp.request(server.port, "PUT", "/ec/m/uint8/inm2", {"If-None-Match": "*"}, data)
    assert fresh.status == 201


def test_concurrent_writers_of_one_key(server: ServerProcess) -> None:
    bodies = [body((256, 256), "U8", 1, seed=i) for i in range(12)]

    def put(data: bytes) -> tuple[int, bytes]:
        response = httpx.put(f"{server.url}/ec/m/uint8/contended", content=data, timeout=30)
        return response.status_code, data

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(put, bodies))
    winners = [data for status, data in results if status == 201]
    assert len(winners) == 1
    assert sorted(status for status, _ in results) == [200] * 11 + [201]
    assert httpx.get(f"{server.url}/ec/m/uint8/contended").content == winners[0]
    assert_nothing_left(server)


def test_concurrent_mixed_traffic_reads_back_exact_bytes(server: ServerProcess) -> None:
    bodies = {f"mix{i}": body((64, 1024), "U8", 1, seed=100 + i) for i in range(16)}

    def work(seed: int) -> list[str]:
        problems = []
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for step in range(30):
                name = f"mix{(seed + step) % 16}"
                action = (seed + 3 * step) % 5
                if action == 0:
                    http.delete(f"/ec/m/uint8/{name}")
                elif action == 1:
                    status = http.put(f"/ec/m/uint8/{name}", content=bodies[name]).status_code
                    if status not in (200, 201):
                        problems.append(f"PUT {status}")
                else:
                    got = http.get(f"/ec/m/uint8/{name}")
                    if got.status_code == 200 and got.content != bodies[name]:
                        problems.append(f"{name}: wrong bytes")
                    elif got.status_code not in (200, 404):
                        problems.append(f"GET {got.status_code}")
        return problems

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        problems = [p for result in pool.map(work, range(8)) for p in result]
    assert problems == []
    assert_nothing_left(server)


def test_other_methods_on_an_entry_path(client: httpx.Client) -> None:
    """The entry routes are served ahead of FastAPI: other methods get a JSON 405 with
    Allow, and POST .../_exists still reaches its own route."""
    for method in ("POST", "PATCH", "OPTIONS"):
        answer = client.request(method, entry_url("m405"))
        assert answer.status_code == 405, method
        assert answer.headers["allow"] == "GET, HEAD, PUT, DELETE"
        assert answer.json()["error"] == "method_not_allowed"
    exists = client.post(f"/ec/{MODEL}/bfloat16/_exists", json={"hashes": ["m405"]})
    assert exists.json() == {"present": [False]}
    operations = client.get("/openapi.json").json()["paths"]["/ec/{model}/{dtype}/{hash}"]
    assert sorted(operations) == ["delete", "get", "head", "put"]
    assert "412" in operations["put"]["responses"]


def test_batch_exists(client: httpx.Client) -> None:
    client.put(entry_url("ex1"), content=body((8,), "BF16", 2))
    client.put(entry_url("ex3"), content=body((8,), "BF16", 2))
    url = f"/ec/{MODEL}/bfloat16/_exists"
    response = client.post(url, json={"hashes": ["ex1", "ex2", "ex3", "ex1"]})
    assert response.json() == {"present": [True, False, True, True]}
    assert client.post(url, json={"hashes": []}).json() == {"present": []}
    many = client.post(url, json={"hashes": [f"h{i}" for i in range(1000)]})
    assert many.json()["present"] == [False] * 1000
    too_many = client.post(url, json={"hashes": [f"h{i}" for i in range(1001)]})
    assert too_many.status_code == 400
    assert too_many.json()["part"] == "hashes"
    bad = client.post(url, json={"hashes": ["ok", "not/ok"]})
    assert bad.status_code == 400
    assert "hashes[1]" in bad.json()["message"]
    assert client.post(url, content=b"{nope", headers=JSON).json()["error"] == "invalid_request"
    assert client.post(url, json={"hash": ["ex1"]}).json()["part"] == "hashes"
    assert client.post(url, json={"hashes": "ex1"}).json()["part"] == "hashes"
    not_json = client.post(url, content=b'{"hashes": []}', headers={"Content-Type": "text/plain"})
    assert (not_json.status_code, not_json.json()["error"]) == (400, "invalid_request")
    with_charset = {"Content-Type": "application/json; charset=utf-8"}
    assert client.post(url, content=b'{"hashes":["ex3"]}', headers=with_charset).json() == {
        "present": [True]
    }
    assert client.post(f"/ec/{MODEL}/float/_exists", json={"hashes": []}).json()["part"] == "dtype"
    assert client.get(url).status_code == 404  # any other method: an entry named "_exists"
    operation = client.get("/openapi.json").json()["paths"]["/ec/{model}/{dtype}/_exists"]
    assert {"200", "400", "413"} <= set(operation["post"]["responses"])


def test_health_readiness_docs_and_stats(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "version": __version__}
    assert client.head("/healthz").status_code == 200  # curl -I works on probes too
    assert client.head("/readyz").status_code == 200
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"disk": "ok"}
    spec = client.get("/openapi.json").json()
    assert "/ec/{model}/{dtype}/{hash}" in spec["paths"]
    assert client.get("/docs").status_code == 200
    stats = client.get("/stats").json()
    assert stats["disk"]["entries"] >= 0
    assert stats["s3_configured"] is False


def test_metrics_count_requests_hits_and_disk(client: httpx.Client) -> None:
    data = body((8,), "BF16", 2)
    client.put(entry_url("met"), content=data)
    client.get(entry_url("met"))
    client.get(entry_url("met-absent"))
    text = client.get("/metrics").text
    assert 'ec_http_requests_total{method="GET",route="entry",status="200"}' in text
    assert 'ec_http_requests_total{method="GET",route="entry",status="404"}' in text
    assert "ec_http_request_duration_seconds_bucket{" in text
    assert 'ec_cache_lookups_total{result="disk"}' in text
    assert 'ec_cache_lookups_total{result="miss"}' in text
    assert "ec_get_bytes_total" in text and "ec_put_bytes_total" in text
    for name in ("ec_disk_used_bytes", "ec_disk_max_bytes", "ec_disk_evictions_total"):
        assert name in text
    assert "met-absent" not in text  # keys never become label values


def test_restart_with_a_populated_data_dir(fresh_server: ServerProcess) -> None:
    fresh_server.start()
    bodies = {f"r{i}": body((1000,), "U8", 1, seed=i) for i in range(20)}
    for name, data in bodies.items():
        assert httpx.put(f"{fresh_server.url}/ec/m/uint8/{name}", content=data).status_code == 201
    fresh_server.stop()
    (fresh_server.data_dir / "tmp" / "put-stray.part").write_bytes(b"left by a crash")
    fresh_server.start()
    for name, data in bodies.items():
        assert httpx.get(f"{fresh_server.url}/ec/m/uint8/{name}").content == data
    assert files_under(fresh_server.data_dir / "tmp") == []
    assert httpx.get(f"{fresh_server.url}/stats").json()["disk"]["entries"] == 20


def test_kill_mid_upload_leaves_no_partial_entry(fresh_server: ServerProcess) -> None:
    fresh_server.start()
    data = body((8 << 20,), "U8", 1)
    sock = socket.create_connection(("127.0.0.1", fresh_server.port))
    sock.sendall(
        f"PUT /ec/m/uint8/killed HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode()
    )
    sock.sendall(data[: 4 << 20])
    wait_for(lambda: files_under(fresh_server.data_dir / "tmp"), "the upload's temp file", 10)
    fresh_server.kill()
    sock.close()
    fresh_server.start()
    assert httpx.get(f"{fresh_server.url}/ec/m/uint8/killed").status_code == 404
    assert files_under(fresh_server.data_dir / "tmp") == []
    assert files_under(fresh_server.data_dir / "objects") == []


def test_corrupted_file_is_a_miss(fresh_server: ServerProcess) -> None:
    fresh_server.start()
    data = body((4096,), "U8", 1)
    url = f"{fresh_server.url}/ec/m/uint8/rot"
    assert httpx.put(url, content=data).status_code == 201
    assert httpx.get(url).content == data
    (path,) = files_under(fresh_server.data_dir / "objects")
    with path.open("r+b") as f:
        f.seek(len(data) - 10)
        f.write(b"\xde\xad")
    assert httpx.get(url).status_code == 404
    assert not path.exists()
    assert httpx.put(url, content=data).status_code == 201
    assert httpx.get(url).content == data


def test_eviction_over_http(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "d", tmp_path / "log", disk_max_bytes="1MiB") as srv:
        bodies = [body((300_000,), "U8", 1, seed=i) for i in range(6)]
        for i, data in enumerate(bodies):
            assert httpx.put(f"{srv.url}/ec/m/uint8/e{i}", content=data).status_code == 201
        present = [httpx.get(f"{srv.url}/ec/m/uint8/e{i}").status_code == 200 for i in range(6)]
        assert present == [False, False, False, True, True, True]
        stats = httpx.get(f"{srv.url}/stats").json()["disk"]
        assert stats["evictions"] == 3
        assert stats["used_bytes"] <= 1 << 20
        too_big = body((2 << 20,), "U8", 1)
        response = httpx.put(f"{srv.url}/ec/m/uint8/huge", content=too_big)
        assert response.status_code == 507
        assert response.json()["error"] == "insufficient_storage"


def test_early_answer_survives_a_client_that_keeps_sending(server: ServerProcess) -> None:
    """A client that gave up waiting for ``100 Continue`` (or never asked) sends its
    body after the server has answered early: the server must drain it rather than
    close with unread bytes, whose reset would destroy the answer in flight."""
    data = body((4 << 20,), "U8", 1)
    assert rawhttp.request(server.port, "PUT", "/ec/m/uint8/early", body=data).status == 201
    head = (
        f"PUT /ec/m/uint8/early HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
        "If-None-Match: *\r\n\r\n"
    ).encode()
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(head)
            # The 412 arrives (and, unfixed, the server closes the socket) first.
            assert select.select([sock], [], [], 10)[0], "no early answer"
            sock.sendall(data)  # into a closed socket this provokes a reset
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 412 "), answer[:200]
        assert b'"already_exists"' in answer


def test_an_upload_read_in_many_pieces_then_the_next_request_on_its_connection(
    server: ServerProcess,
) -> None:
    """A PUT body sent in small writes (most of it is counted off past the HTTP parser,
    see ``app.http_protocol``), its last bytes in one write with a GET pipelined behind
    them: both are answered on the connection, the GET with the body stored."""
    data = body((3_000_000,), "U8", 1, seed=7)
    target = entry_url("many-pieces", "uint8")
    head = f"PUT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n"
    get = f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    answers = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head.encode() + data[:100])
        for start in range(100, len(data) - 1000, 65_536):
            sock.sendall(data[start : min(start + 65_536, len(data) - 1000)])
            time.sleep(0.0005)  # the behaviour under test: pieces arriving one by one
        sock.sendall(data[len(data) - 1000 :] + get.encode())
        while chunk := sock.recv(1 << 20):
            answers += chunk
    put_head, _, rest = answers.partition(b"\r\n\r\n")
    assert put_head.startswith(b"HTTP/1.1 201 "), put_head
    put_length = int(put_head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    get_head, _, stored = rest[put_length:].partition(b"\r\n\r\n")
    assert get_head.startswith(b"HTTP/1.1 200 "), get_head
    assert stored == data


#: Body sizes around the protocol's edges: tiny, a read buffer (1 MiB) and its
#: neighbours, several buffers.
_EDGE_SIZES = (1, 4096, 65_535, 1_048_575, 1_048_576, 1_048_577, 2_097_153, 3_000_001)


def _split_responses(answers: bytes) -> list[tuple[int, bytes]]:
    """Status and body of each Content-Length-framed response in ``answers``."""
    found = []
    while answers:
        head, _, rest = answers.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        fields = dict(line.lower().split(b": ", 1) for line in lines[1:])
        length = int(fields.get(b"content-length", b"0"))
        found.append((int(lines[0].split()[1]), rest[:length]))
        answers = rest[length:]
    return found


@pytest.mark.parametrize("seed", range(6))
def test_pipelined_uploads_cut_at_random_points_are_stored_exactly(
    server: ServerProcess, seed: int
) -> None:
    """Several PUTs (some chunked) and GETs pipelined on one connection, the whole byte
    stream cut at random points (inside heads, bodies and read-buffer boundaries) and
    sent with pauses: every PUT is stored, every GET answers its bytes, in order."""
    rng = random.Random(seed)
    sizes = [rng.choice(_EDGE_SIZES) for _ in range(3)]
    datas = [body((n,), "U8", 1, seed=seed * 10 + i) for i, n in enumerate(sizes)]
    targets = [entry_url(f"pipelined-{seed}-{i}", "uint8") for i in range(len(datas))]
    stream = b""
    for target, data in zip(targets, datas, strict=True):
        if rng.random() < 0.25:  # chunked: framed by llhttp, not counted off
            stream += (
                f"PUT {target} HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            )
            for start in range(0, len(data), 300_000):
                piece = data[start : start + 300_000]
                stream += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
            stream += b"0\r\n\r\n"
        else:
            head = f"PUT {target} HTTP/1.1\r\nHost: h\r\nContent-Length: {len(data)}\r\n\r\n"
            stream += head.encode() + data
    for i, target in enumerate(targets):
        close = "Connection: close\r\n" if i == len(targets) - 1 else ""
        stream += f"GET {target} HTTP/1.1\r\nHost: h\r\n{close}\r\n".encode()
    cuts = sorted(rng.sample(range(1, len(stream)), 40))
    answers = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            sock.sendall(stream[start:end])
            if rng.random() < 0.3:
                time.sleep(0.002)  # the behaviour under test: cuts arriving apart
        while chunk := sock.recv(1 << 20):
            answers += chunk
    responses = _split_responses(answers)
    assert [status for status, _ in responses] == [201] * len(datas) + [200] * len(datas)
    assert [stored for _, stored in responses[len(datas) :]] == datas
