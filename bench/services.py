"""Everything the benchmark starts on 127.0.0.1 (and stops by PID): SeaweedFS, nginx and
ec-cache servers; plus small helpers that watch them (write-back drain, memory)."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.nginx import Nginx
from testkit.s3 import S3Endpoint, seaweedfs_endpoint
from testkit.server import ServerProcess, server_python

BUCKET = "ec-bench"


def http_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


class Services:
    """Starts what a section needs; :meth:`close` stops all of it, newest first."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._stack = contextlib.ExitStack()
        self._s3: S3Endpoint | None = None
        self._nginx: Nginx | None = None

    # -- S3 -----------------------------------------------------------------------
    def s3(self) -> S3Endpoint:
        if self._s3 is None:
            self._s3 = self._stack.enter_context(
                seaweedfs_endpoint(self.root / "seaweedfs", BUCKET)
            )
        return self._s3

    # -- nginx --------------------------------------------------------------------
    def nginx(self) -> Nginx:
        if self._nginx is None:
            root = self.root / "nginx"
            root.mkdir(parents=True)
            nginx = Nginx(root).start()
            self._stack.callback(nginx.stop)
            self._nginx = nginx
        return self._nginx

    # -- ec-cache -----------------------------------------------------------------
    def server(
        self, name: str, *, s3_prefix: str | None = None, **settings: str | int
    ) -> ServerProcess:
        """A fresh ``python -m app`` with its own empty data directory."""
        data = self.root / f"ec-{name}"
        shutil.rmtree(data, ignore_errors=True)
        proc = ServerProcess(data, self.root / f"ec-{name}.log")
        proc.env.update({f"EC_{key.upper()}": str(value) for key, value in settings.items()})
        if s3_prefix is not None:
            proc.env.update(self.s3().env(prefix=s3_prefix))
        proc.start()
        self._stack.callback(proc.stop)
        return proc

    def asgi_floor(self, name: str, file: Path) -> ServerProcess:
        """``bench.asgi_floor`` serving ``file`` on ec-cache's uvicorn options."""
        proc = ServerProcess(
            self.root / f"floor-{name}",
            self.root / f"floor-{name}.log",
            command=[server_python(), "-m", "bench.asgi_floor", str(file)],
        )
        proc.start()
        self._stack.callback(proc.stop)
        return proc

    def stop_server(self, proc: ServerProcess) -> None:
        """Stop a server before the end (its callback then does nothing)."""
        proc.stop()
        shutil.rmtree(proc.data_dir, ignore_errors=True)

    def close(self) -> None:
        self._stack.close()


def wait_upload_queue_empty(url: str, timeout: float = 300.0) -> float:
    """Seconds until a write-back server's upload queue is empty."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        queue = http_json(url + "/stats").get("upload_queue", {})
        if not queue.get("entries"):
            return time.monotonic() - start
        time.sleep(0.02)
    raise RuntimeError(f"write-back queue of {url} did not drain in {timeout}s")


_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")


def proc_memory(pid: int) -> dict[str, int]:
    """``/proc/<pid>/status`` memory fields, in bytes."""
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in _FIELDS:
                values[name] = int(rest.split()[0]) * 1024
    return values


class MemorySampler:
    """Samples a process's memory every ``interval`` s in a thread; keeps the peaks."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid = pid
        self.interval = interval
        self.peak: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                for name, value in proc_memory(self.pid).items():
                    self.peak[name] = max(self.peak.get(name, 0), value)
                self.samples += 1
            self._stop.wait(self.interval)

    @contextlib.contextmanager
    def running(self) -> Iterator[MemorySampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


def time_to_healthz(proc: ServerProcess, timeout: float = 300.0) -> float:
    """Start ``proc`` (not yet started) and return seconds until ``/healthz`` answers 200,
    polling every 5 ms with a raw socket."""
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    start = time.perf_counter()
    proc.start(wait=False)
    assert proc.proc is not None
    while time.perf_counter() - start < timeout:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{proc.log_path.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", proc.port), timeout=1) as sock:
                sock.sendall(request)
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.005)
    proc.stop()
    raise RuntimeError(f"server did not answer /healthz in {timeout}s")
