"""Deadlines and bounds against slow or hostile clients, on real server processes.

Tricklers, stalled readers, slowloris heads, idle and excess connections: each is cut
off within its configured time, and well-behaved clients are served meanwhile.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx

from tests.e2e import rawhttp
from tests.support.entries import body
from tests.support.server import ServerProcess


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
            answer = rawhttp._read_response(self.sock)
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
        time.sleep(0.3)
        # One slot is still free: a normal PUT is served while the tricklers trickle.
        normal = body((500_000,), "U8", 1, seed=1)
        assert httpx.put(srv.url + "/ec/m/uint8/normal", content=normal).status_code == 201
        tricklers.append(Trickler(srv.port, "/ec/m/uint8/trickle2", data))
        time.sleep(0.3)
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
