"""Group commit against a real server: concurrent PUTs share one batch of fsyncs.

The server runs with ``EC_DISK_COMMIT_DELAY``, so its committer waits for uploads still
being received. The test holds 8 uploads open half-sent until the server counts all 8
in flight (``/stats``), then finishes them together: every PUT must be acknowledged,
readable and byte-identical, and the server's counters must show one batch of 8.
No timing is asserted.
"""

from __future__ import annotations

import concurrent.futures
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.entries import body, crc_hex
from testkit.polling import wait_for
from testkit.server import ServerProcess
from tests.e2e import rawhttp

UPLOADS = 8
PATH = "/ec/group/commit/uint8/{}"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    with ServerProcess(tmp_path / "data", tmp_path / "server.log", disk_commit_delay=10) as srv:
        yield srv


def _stats(srv: ServerProcess) -> dict[str, int]:
    disk: dict[str, int] = httpx.get(srv.url + "/stats", timeout=10).json()["disk"]
    return disk


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the response"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split(b" ")[1]), rest[:length]


def test_concurrent_puts_share_one_commit(server: ServerProcess) -> None:
    bodies = [body((1_000_000,), "U8", 1, seed=i) for i in range(UPLOADS)]
    before = _stats(server)
    sockets = []
    try:
        for i, data in enumerate(bodies):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sockets.append(sock)
            head = (
                f"PUT {PATH.format(f'h{i}')} HTTP/1.1\r\nHost: x\r\n"
                f"Content-Length: {len(data)}\r\nX-EC-CRC32C: {crc_hex(data)}\r\n\r\n"
            ).encode()
            sock.sendall(head + data[: len(data) // 2])
        wait_for(lambda: server.uploads_in_flight() >= UPLOADS, "every upload under way")
        for sock, data in zip(sockets, bodies, strict=True):
            sock.sendall(data[len(data) // 2 :])
        answers = [_read_response(sock) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
    assert [status for status, _ in answers] == [201] * UPLOADS, answers
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for i, data in enumerate(bodies):
            got = http.get(PATH.format(f"h{i}"))
            assert got.status_code == 200 and got.content == data
        metrics = http.get("/metrics").text
    after = _stats(server)
    assert after["commit_batches"] - before["commit_batches"] == 1
    assert after["committed_entries"] - before["committed_entries"] == UPLOADS
    assert "ec_disk_commit_batch_size_count 1.0" in metrics
    assert f"ec_disk_commit_batch_size_sum {float(UPLOADS)}" in metrics
    assert 'ec_disk_commit_batch_size_bucket{le="4.0"} 0.0' in metrics
    assert f'ec_disk_commit_fsyncs_total{{kind="file"}} {float(UPLOADS)}' in metrics
    assert not list((server.data_dir / "tmp").iterdir())


def test_commits_without_delay_still_group_nothing_lost(tmp_path: Path) -> None:
    """Default settings (no delay): 16 concurrent PUTs are all acknowledged and stored,
    and every entry is counted in exactly one batch."""
    bodies = [body((200_000,), "U8", 1, seed=100 + i) for i in range(16)]
    with ServerProcess(tmp_path / "data", tmp_path / "server.log") as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:

            def put(i: int) -> int:
                return http.put(
                    PATH.format(f"d{i}"),
                    content=bodies[i],
                    headers={"X-EC-CRC32C": crc_hex(bodies[i])},
                ).status_code

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                assert list(pool.map(put, range(16))) == [201] * 16
            for i, data in enumerate(bodies):
                assert http.get(PATH.format(f"d{i}")).content == data
        stats = _stats(srv)
        assert stats["committed_entries"] == 16
        assert 1 <= stats["commit_batches"] <= 16


def test_the_loser_of_a_race_in_one_batch_is_answered_with_the_stored_entry(
    server: ServerProcess,
) -> None:
    """Two PUTs of one key with different bodies, committed in one batch: one is 201,
    the other 200 describing the winner's entry (size, CRC32C, ETag), sent only once
    that entry is readable: a GET right after either answer returns the winner's bytes."""
    path = PATH.format("raced")
    bodies = [body((300_000 + i,), "U8", 1, seed=200 + i) for i in range(2)]
    sockets = []
    try:
        for data in bodies:
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sockets.append(sock)
            head = f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
            sock.sendall(head.encode() + data[:1000])
        wait_for(lambda: server.uploads_in_flight() >= 2, "both uploads under way")
        for sock, data in zip(sockets, bodies, strict=True):
            sock.sendall(data[1000:])
        answers = []
        for sock in sockets:
            answer = rawhttp.read_response(sock)
            # At once, before the other answer is read.
            answers.append((answer, httpx.get(server.url + path, timeout=30)))
    finally:
        for sock in sockets:
            sock.close()
    assert sorted(answer.status for answer, _ in answers) == [200, 201]
    winner = bodies[[answer.status for answer, _ in answers].index(201)]
    for answer, got in answers:
        assert got.status_code == 200 and got.content == winner
        described = answer.json()
        assert described["size"] == len(winner)
        assert described["crc32c"] == crc_hex(winner)
        assert answer.headers["etag"] == f'"{crc_hex(winner)}"'
    assert not list((server.data_dir / "tmp").iterdir())
