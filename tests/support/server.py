"""A real ec-cache server in a subprocess, on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


#: The interpreter that runs the server: this one, or the server's own venv where the
#: tests run elsewhere (the SDK's tests at its dependency floor, ``make sdk-floor-tests``).
SERVER_PYTHON = os.environ.get("EC_SERVER_PYTHON", sys.executable)


class ServerProcess:
    """``python -m app`` (or another ``module`` that reads ``EC_HOST``/``EC_PORT``, with
    ``args``) with ``EC_*`` settings; ``start``/``stop``/``kill`` by PID."""

    def __init__(
        self,
        data_dir: Path,
        log_path: Path,
        *,
        module: str = "app",
        args: tuple[str, ...] = (),
        **settings: str | int,
    ) -> None:
        self.command = [SERVER_PYTHON, "-m", module, *args]
        self.data_dir = data_dir
        self.log_path = log_path
        self.port = int(settings.pop("port", 0)) or free_port()
        self.env = {
            **os.environ,
            "EC_HOST": "127.0.0.1",
            "EC_PORT": str(self.port),
            "EC_DATA_DIR": str(data_dir),
            "EC_LOG_LEVEL": "warning",
            **{f"EC_{name.upper()}": str(value) for name, value in settings.items()},
        }
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> ServerProcess:
        """Start the process and, unless ``wait`` is false, wait for ``/healthz``."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=log)
        if not wait:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server did not start in {timeout}s:\n{self.log_path.read_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
