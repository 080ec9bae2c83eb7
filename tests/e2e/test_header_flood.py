"""Request heads are bounded while they arrive (app/http_protocol/guarded.py): a client
that floods headers gets its 431 at once and costs the server no memory to speak of,
while a head at the limit, however it is cut into reads, is still served."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.polling import wait_for
from testkit.server import ServerProcess
from tests.e2e import rawhttp

FLOODERS = 4
FLOOD_BYTES = 16 * 1024 * 1024  # per flooder, unless the server answers first
MAX_HEADER_BYTES = 16 * 1024  # the default EC_MAX_HEADER_BYTES


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("flood")
    with ServerProcess(root / "data", root / "log") as srv:
        yield srv


def _server_unread(server_port: int, client_port: int) -> int | None:
    """Bytes waiting in the server's receive queue on the connection from
    ``client_port`` (/proc/net/tcp); None until the kernel lists the connection."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = fields[1], fields[2], fields[4]
        if (
            int(local.split(":")[1], 16) == server_port
            and int(remote.split(":")[1], 16) == client_port
        ):
            return int(queues.split(":")[1], 16)
    return None


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB$", status, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


def _dropped_for_headers(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(
        r'^ec_connections_dropped_total\{reason="headers_too_large"\} (\S+)$', text, re.MULTILINE
    )
    assert match is not None
    return float(match.group(1))


def test_flooders_get_431_at_once_and_memory_stays_flat(server: ServerProcess) -> None:
    assert server.proc is not None
    before = _rss_bytes(server.proc.pid)
    dropped_before = _dropped_for_headers(server.url)
    results: list[tuple[int, rawhttp.RawResponse | None]] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(rawhttp.flood_headers(server.port, FLOOD_BYTES))
        )
        for _ in range(FLOODERS)
    ]
    for thread in threads:
        thread.start()
    # The server keeps serving others meanwhile.
    assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
    for thread in threads:
        thread.join()
    after = _rss_bytes(server.proc.pid)

    assert len(results) == FLOODERS
    for sent, answer in results:
        assert answer is not None, "hung up without an answer"
        assert answer.status == 431
        assert answer.json()["error"] == "headers_too_large"
        assert str(MAX_HEADER_BYTES) in answer.json()["message"]
        assert sent < FLOOD_BYTES, "the answer came only once the whole flood was sent"
    assert _dropped_for_headers(server.url) == dropped_before + FLOODERS
    assert after - before < 8 * 1024 * 1024, f"RSS grew by {(after - before) / 2**20:.1f} MiB"


def test_a_flooded_target_gets_414(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /" + b"a" * 64 * 1024)
        answer = rawhttp.read_response(sock)
    assert answer.status == 414
    assert answer.json()["error"] == "uri_too_long"


def _send_in_pieces(port: int, head: bytes, piece: int) -> rawhttp.RawResponse:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for start in range(0, len(head), piece):
            sock.sendall(head[start : start + piece])
        return rawhttp.read_response(sock)


@pytest.mark.parametrize("piece", [512, 64 * 1024])
def test_a_head_at_the_limit_is_served_however_it_arrives(
    server: ServerProcess, piece: int
) -> None:
    """The middleware counts name + value + 4 per header; a head of exactly
    EC_MAX_HEADER_BYTES is served, one byte more is 431, whatever the reads."""
    host = (b"host", b"x")
    filler_value = MAX_HEADER_BYTES - (len(host[0]) + len(host[1]) + 4) - (len(b"x-fill") + 4)

    def head(value_bytes: int) -> bytes:
        return b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-fill: " + b"f" * value_bytes + b"\r\n\r\n"

    assert _send_in_pieces(server.port, head(filler_value), piece).status == 200
    assert _send_in_pieces(server.port, head(filler_value + 1), piece).status == 431


def test_pipelined_heads_near_the_limit_are_served(server: ServerProcess) -> None:
    """A read that ends one head and begins the next counts only the next one's bytes."""

    def head(extra: str) -> bytes:
        start = f"GET /healthz HTTP/1.1\r\nhost: x\r\n{extra}x-fill: ".encode()
        return start + b"v" * 15_000 + b"\r\n\r\n"

    first, second = head(""), head("connection: close\r\n")
    pieces = [first[:1024], first[1024:] + second[:10_000], second[10_000:]]
    answers = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_port = sock.getsockname()[1]
        for piece in pieces:
            sock.sendall(piece)
            # Each piece its own read: wait until the server has read it.
            wait_for(
                lambda: _server_unread(server.port, client_port) == 0,
                what="the server to read the piece",
            )
        while chunk := sock.recv(65536):
            answers += chunk
    assert re.findall(rb"HTTP/1.1 (\d+) ", answers) == [b"200", b"200"], answers
