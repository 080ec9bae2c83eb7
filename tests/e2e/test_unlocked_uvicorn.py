"""The server on a uvicorn other than the locked one (``make`` installs uvicorn 0.34.3
into ``.venv/other-uvicorn``): it warns, serves with uvicorn's stock h11 protocol
instead of the adapter (app/http_protocol), and keeps its connection bound, keep-alive
deadline and a bound on request heads through uvicorn's own settings. Upgrade requests
on it: tests/e2e/test_upgrade.py."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.http_protocol import LOCKED
from testkit.entries import body, crc_hex
from testkit.polling import wait_for
from testkit.server import ServerProcess
from tests.e2e import rawhttp

OTHER_UVICORN = Path(sys.prefix) / "other-uvicorn"
ENTRY = "/ec/unlocked/test/bfloat16/h1"


@pytest.fixture(scope="module")
def unlocked_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    if not (OTHER_UVICORN / "uvicorn").is_dir():
        pytest.fail(f"{OTHER_UVICORN} is missing: `make .venv/.test` installs it")
    root = tmp_path_factory.mktemp("unlocked")
    srv = ServerProcess(root / "data", root / "server.log", max_connections=3, keepalive_timeout=1)
    srv.env["PYTHONPATH"] = str(OTHER_UVICORN)
    with srv:
        yield srv


def test_it_warns_and_names_the_versions(unlocked_server: ServerProcess) -> None:
    log = unlocked_server.log_path.read_text()
    assert "uvicorn 0.34.3 is installed" in log
    assert f"written for httptools {LOCKED['httptools']}, uvicorn {LOCKED['uvicorn']}" in log
    assert "stock h11 protocol" in log
    assert "would lose the body of a request carrying Upgrade:" in log


def test_a_4_7_mb_entry_round_trips(unlocked_server: ServerProcess) -> None:
    data = body((576, 4096), "BF16", 2, seed=7)
    with httpx.Client(base_url=unlocked_server.url, timeout=30) as http:
        put = http.put(ENTRY, content=data, headers={"X-EC-CRC32C": crc_hex(data)})
        assert put.status_code == 201, put.text
        head = http.head(ENTRY)
        assert head.status_code == 200
        assert int(head.headers["content-length"]) == len(data)
        assert head.headers["x-ec-shape"] == "576,4096"
        got = http.get(ENTRY)
        assert got.status_code == 200
        assert got.content == data
        assert http.put(ENTRY, content=data).status_code == 200  # first writer won


def _healthz(sock: socket.socket) -> int:
    """Send ``GET /healthz`` on ``sock``; its status, the whole answer read."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(4096)
    head, _, rest = answer.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(rest) < length:
        rest += sock.recv(4096)
    return int(head.split()[1])


def _open_idle(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert _healthz(sock) == 200
    return sock


def test_connection_bound_and_keepalive_deadline(unlocked_server: ServerProcess) -> None:
    held = [_open_idle(unlocked_server.port) for _ in range(3)]
    try:
        # EC_MAX_CONNECTIONS=3 as uvicorn's limit_concurrency: a 4th is refused.
        with socket.create_connection(("127.0.0.1", unlocked_server.port), timeout=5) as s:
            assert _healthz(s) == 503
        # EC_KEEPALIVE_TIMEOUT=1: the idle connections are closed by the server.
        started = time.monotonic()
        for sock in held:
            assert sock.recv(1) == b""
        assert time.monotonic() - started < 4
    finally:
        for sock in held:
            sock.close()
    # Served again once uvicorn has forgotten the closed connections (its limit counts them).
    wait_for(
        lambda: httpx.get(f"{unlocked_server.url}/healthz").status_code == 200,
        "the server to serve again",
    )


def test_a_header_flood_is_cut_off(unlocked_server: ServerProcess) -> None:
    """h11 bounds the head it buffers (``h11_max_incomplete_event_size``, set to the
    adapter's bound): uvicorn's plain-text 400 comes before the flood is sent."""
    flood = 16 * 1024 * 1024
    sent, answer = rawhttp.flood_headers(unlocked_server.port, flood)
    assert answer is not None and answer.status == 400
    assert sent < flood
