"""Deadlines and bounds against slow or hostile clients, on real server processes.

Tricklers, stalled readers, slowloris heads, idle and excess connections: each is cut
off within its configured time, and well-behaved clients are served meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import httpx

from testkit.entries import body
from testkit.polling import wait_for
from testkit.server import ServerProcess
from tests.e2e import rawhttp


class Trickler:
    """A PUT whose body goes out one byte every ``pace`` seconds, from a thread."""

    def __init__(self, port: int, path: str, data: bytes, pace: float = 0.3) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        self.sock.sendall(
            f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        )
        self.started = time.monotonic()
        self.data = data
        self.pace = pace
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _trickle(self) -> None:
        for i in range(len(self.data)):
            if self.stop.wait(self.pace):
                return
            try:
                self.sock.send(self.data[i : i + 1])
            except OSError:
                return

    def response(self) -> tuple[int, str, float]:
        """(status, error code, seconds from the start) of the server's answer."""
        try:
            answer = rawhttp.read_response(self.sock)
        finally:
            self.stop.set()
            self.thread.join()
            self.sock.close()
        return answer.status, answer.json()["error"], time.monotonic() - self.started


def test_trickling_uploads_are_cut_off_and_others_get_through(tmp_path: Path) -> None:
    grace = 2.0
    with ServerProcess(
        tmp_path / "d",
        tmp_path / "log",
        max_concurrent_uploads="3",
        upload_rate_grace=str(grace),
        upload_min_rate="64KiB",
    ) as srv:
        data = body((100_000,), "U8", 1)
        tricklers = [Trickler(srv.port, f"/ec/m/uint8/trickle{i}", data) for i in range(2)]
        wait_for(lambda: srv.uploads_in_flight() == 2, "both tricklers' uploads to start")
        # One slot is still free: a normal PUT is served while the tricklers trickle.
        normal = body((500_000,), "U8", 1, seed=1)
        assert httpx.put(srv.url + "/ec/m/uint8/normal", content=normal).status_code == 201
        tricklers.append(Trickler(srv.port, "/ec/m/uint8/trickle2", data))
        wait_for(lambda: srv.uploads_in_flight() == 3, "the third trickler's upload")
        refused = httpx.put(srv.url + "/ec/m/uint8/refused", content=normal)
        assert refused.status_code == 503  # every slot held, for now
        for trickler in tricklers:
            status, code, seconds = trickler.response()
            assert (status, code) == (408, "request_timeout")
            assert seconds < grace + 3  # the grace period, then the rate check
        # Their slots are free again, and they left nothing behind.
        assert httpx.put(srv.url + "/ec/m/uint8/after", content=normal).status_code == 201
        assert list((tmp_path / "d" / "tmp").iterdir()) == []
        for i in range(3):
            assert httpx.head(f"{srv.url}/ec/m/uint8/trickle{i}").status_code == 404
        assert httpx.get(srv.url + "/ec/m/uint8/normal").content == normal


def test_upload_total_deadline(tmp_path: Path) -> None:
    # Fast enough for the rate rule, but the whole body may take at most 2 s.
    with ServerProcess(
        tmp_path / "d", tmp_path / "log", upload_timeout="2", upload_min_rate="0"
    ) as srv:
        trickler = Trickler(srv.port, "/ec/m/uint8/slow", body((100_000,), "U8", 1), pace=0.1)
        status, code, seconds = trickler.response()
        assert (status, code) == (408, "request_timeout")
        assert 1.5 < seconds < 6
        assert list((tmp_path / "d" / "tmp").iterdir()) == []
        assert httpx.head(srv.url + "/ec/m/uint8/slow").status_code == 404


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
    """Read until the server closes (EOF or reset); (bytes read, seconds it took).
    Raises TimeoutError when the connection is still open after ``seconds``."""
    start = time.monotonic()
    sock.settimeout(seconds)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - start


def _accepted(srv: ServerProcess, ports: set[int]) -> int:
    """How many connections from the client ``ports`` the server process holds a socket
    of: accepted, not just queued by the kernel (which completes handshakes before
    ``accept``)."""
    assert srv.proc is not None
    inodes = set()
    for fd in Path(f"/proc/{srv.proc.pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()  # sl, local, remote, state, ..., inode (the 10th)
        if fields[9] in inodes and int(fields[2].rsplit(":", 1)[1], 16) in ports:
            count += 1
    return count


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_idle_connections_are_closed(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "d", tmp_path / "log", keepalive_timeout="1") as srv:
        never = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(50)]
        after_one = socket.create_connection(("127.0.0.1", srv.port))
        after_one.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert rawhttp.read_response(after_one).status == 200
        for sock in [*never, after_one]:
            data, seconds = _closed_within(sock, 5)
            assert data == b""  # closed without a word: it asked nothing
            assert seconds < 3
            sock.close()
        assert _metric(srv.url, 'ec_connections_dropped_total{reason="idle"}') >= 51


def test_slowloris_heads_are_answered_408_and_closed(tmp_path: Path) -> None:
    with ServerProcess(
        tmp_path / "d", tmp_path / "log", header_timeout="1", keepalive_timeout="30"
    ) as srv:
        lorises = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(20)]
        started = time.monotonic()
        stop = threading.Event()

        def trickle() -> None:
            for sock in lorises:
                sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            for i in range(100):
                if stop.wait(0.2):
                    return
                for sock in lorises:
                    with contextlib.suppress(OSError):
                        sock.sendall(f"X-Slow-{i}: y\r\n".encode())

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        try:
            # Every loris is in (its connection counted), then others are still served.
            wait_for(lambda: _metric(srv.url, "ec_connections_open") >= 21, "the lorises")
            assert httpx.get(srv.url + "/healthz").status_code == 200
            for sock in lorises:
                response = rawhttp.read_response(sock)
                assert response.status == 408
                assert response.json()["error"] == "request_timeout"
                assert time.monotonic() - started < 4
        finally:
            stop.set()
            thread.join()
            for sock in lorises:
                sock.close()
        # A body other than a PUT's must arrive within the same deadline, an Upgrade
        # request's too (llhttp ends that request at its head: not its end).
        for upgrade in (b"", b"Connection: Upgrade\r\nUpgrade: h2c\r\n"):
            post = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            post.sendall(
                b"POST /ec/m/uint8/_exists HTTP/1.1\r\nHost: x\r\n" + upgrade + b"Content-Type: "
                b'application/json\r\nContent-Length: 100\r\n\r\n{"hashes": '
            )
            started = time.monotonic()
            response = rawhttp.read_response(post)
            post.close()
            assert (response.status, response.json()["error"]) == (408, "request_timeout")
            assert time.monotonic() - started < 4
        assert _metric(srv.url, 'ec_connections_dropped_total{reason="header_timeout"}') == 22


def test_stalled_reader_is_dropped_and_frees_its_slot(tmp_path: Path) -> None:
    with ServerProcess(
        tmp_path / "d",
        tmp_path / "log",
        send_timeout="1",
        max_concurrent_downloads="1",
        keepalive_timeout="30",
    ) as srv:
        data = body((32_000_000,), "U8", 1)
        assert httpx.put(srv.url + "/ec/m/uint8/large", content=data).status_code == 201
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        stalled.connect(("127.0.0.1", srv.port))
        stalled.sendall(b"GET /ec/m/uint8/large HTTP/1.1\r\nHost: x\r\n\r\n")
        # It reads nothing: the server must give up on it (send_timeout: 1 s).
        wait_for(
            lambda: _metric(srv.url, 'ec_connections_dropped_total{reason="send_timeout"}') == 1,
            "the stalled reader to be dropped",
            timeout=15,
        )
        # The slot is free and the next reader gets every byte.
        assert httpx.get(srv.url + "/ec/m/uint8/large").content == data
        received, _ = _closed_within(stalled, 5)
        stalled.close()
        assert len(received) < len(data)  # cut off, not sent in full


def test_connections_beyond_the_bound_are_refused_at_once(tmp_path: Path) -> None:
    with ServerProcess(
        tmp_path / "d", tmp_path / "log", max_connections="20", keepalive_timeout="30"
    ) as srv:
        held = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(20)]
        ports = {sock.getsockname()[1] for sock in held}
        # All accepted by the server (asking /metrics would be a 21st connection).
        wait_for(lambda: _accepted(srv, ports) == 20, "the server to accept all 20")
        extra = socket.create_connection(("127.0.0.1", srv.port))
        data, seconds = _closed_within(extra, 5)
        extra.close()
        assert seconds < 1
        assert b" 503 " in data.split(b"\r\n", 1)[0]
        assert b'"too_many_connections"' in data
        for sock in held:
            sock.close()
        wait_for(lambda: _accepted(srv, ports) == 0, "the server to close them too")
        assert httpx.get(srv.url + "/healthz").status_code == 200
        assert _metric(srv.url, 'ec_connections_dropped_total{reason="limit"}') == 1


def test_upgrade_requests_are_plain_http(server: ServerProcess) -> None:
    # No WebSocket routes: an Upgrade header neither switches protocols (escaping the
    # connection bounds) nor writes warnings to the log.
    upgrade = {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    }
    for _ in range(3):
        assert rawhttp.request(server.port, "GET", "/healthz", upgrade).status == 200
    # Closed, not switched: only the metrics request's own connection stays open.
    wait_for(lambda: _metric(server.url, "ec_connections_open") == 1, "the upgrades to close")
    assert "WebSocket" not in server.log_path.read_text()
