"""A real ec-cache server in a subprocess, on a free loopback port, stopped by PID.

Standard library only: the deployment checks' venv and a GPU machine's bare python3
start servers with it too.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from testkit.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SERVER_VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


def server_python() -> str:
    """The interpreter that runs the server: ``$EC_SERVER_PYTHON``; else the repository's
    ``.venv``, the server's own environment (``make`` builds it), for tests that run in
    another one (tests/vllm in .venv-vllm, tests/deploy in the deployment tools' venv);
    else this interpreter."""
    configured = os.environ.get("EC_SERVER_PYTHON")
    if configured:
        return configured
    return str(SERVER_VENV_PYTHON) if SERVER_VENV_PYTHON.exists() else sys.executable


def answers_healthz(port: int) -> bool:
    """Whether a server on ``port`` answers ``GET /healthz`` with 200 (no proxy asked)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def settings_env(settings: Mapping[str, str | int]) -> dict[str, str]:
    """``EC_*`` variables of ``settings`` named without the prefix (``log_level``)."""
    return {f"EC_{name.upper()}": str(value) for name, value in settings.items()}


class ServerProcess:
    """``python -m app`` (or another ``command`` that reads ``EC_HOST``/``EC_PORT``, such
    as an installed entry point) with ``EC_*`` settings on top of ``env`` (default: this
    process's environment); ``start``/``stop``/``kill`` by PID."""

    def __init__(
        self,
        data_dir: Path,
        log_path: Path,
        *,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        **settings: str | int,
    ) -> None:
        self.command = list(command or [server_python(), "-m", "app"])
        self.data_dir = data_dir
        self.log_path = log_path
        self.cwd = cwd
        self.port = int(settings.pop("port", 0)) or free_port()
        self.env = {
            **(os.environ if env is None else env),
            "EC_HOST": "127.0.0.1",
            "EC_PORT": str(self.port),
            "EC_DATA_DIR": str(data_dir),
            "EC_LOG_LEVEL": "warning",
            **settings_env(settings),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> Self:
        """Start the process and, unless ``wait`` is false, wait for ``/healthz``."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command, env=self.env, cwd=self.cwd, stdout=log, stderr=log
            )
        if not wait:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()}")
            if answers_healthz(self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server did not start in {timeout}s:\n{self.log_path.read_text()}")

    def uploads_in_flight(self) -> int:
        """Entry bodies the server is receiving now (``/stats``: ``writes_in_flight``)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/stats")
            stats = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        return int(stats["disk"]["writes_in_flight"])

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

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
