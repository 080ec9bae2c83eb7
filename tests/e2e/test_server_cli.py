"""``python -m app`` as an operator meets it: ``--help``, ``--version`` and ``--check``
serve nothing; a started server says its version (log, ``/healthz``, ``ec_build_info``),
exports ``process_*`` metrics and names every ``EC_*`` variable it ignores."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx

from app import __version__
from testkit.ports import free_port
from testkit.server import ServerProcess, server_python


def _app(*arguments: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m app ...`` with ``env`` over a clean ``EC_*``-free environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("EC_")}
    return subprocess.run(
        [server_python(), "-m", "app", *arguments],
        env={**base, "EC_PORT": str(free_port()), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_help_lists_the_settings_and_serves_nothing(tmp_path: Path) -> None:
    done = _app("--help", env={"EC_DATA_DIR": str(tmp_path / "data")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m app")
    assert re.search(r"^  EC_S3_ENDPOINT_URL +unset$", done.stdout, re.MULTILINE)
    assert re.search(r"^  EC_DISK_MAX_BYTES +10GiB$", done.stdout, re.MULTILINE)
    assert "--check" in done.stdout
    assert not (tmp_path / "data").exists()


def test_version(tmp_path: Path) -> None:
    done = _app("--version", env={"EC_DATA_DIR": str(tmp_path / "data")})
    assert (done.returncode, done.stdout) == (0, f"ec-cache {__version__}\n")
    assert not (tmp_path / "data").exists()


def test_a_server_says_its_version_and_exports_process_metrics(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "data", tmp_path / "log", log_level="info") as srv:
        assert httpx.get(f"{srv.url}/healthz").json() == {"status": "ok", "version": __version__}
        metrics = httpx.get(f"{srv.url}/metrics").text
    assert 'ec_build_info{python="' in metrics
    assert re.search(
        rf'^ec_build_info\{{.*version="{re.escape(__version__)}".*\}} 1\.0$', metrics, re.M
    )
    for series in (
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_cpu_seconds_total",
    ):
        assert re.search(rf"^{series} [0-9.e+]+$", metrics, re.MULTILINE), series
    assert (
        f"ec-cache {__version__} on http://127.0.0.1:{srv.port}" in (tmp_path / "log").read_text()
    )


def test_ignored_variables_are_named_at_start_up(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "data", tmp_path / "log")
    srv.env.update(
        {
            "EC_S3_ENDPIONT": "http://s3.example:9000",  # a misspelled setting
            "EC_S3_ACCESS_KEY_ID": "key",  # docker-compose.yml's, not the server's
            "EC_SOMETHING_ELSE": "1",
            "EC_CACHE_URL": "http://127.0.0.1:1",  # the SDK's: no warning
        }
    )
    with srv:
        assert httpx.get(f"{srv.url}/healthz").status_code == 200
    log = (tmp_path / "log").read_text()
    assert (
        "WARNING app: EC_S3_ENDPIONT is not a setting and is ignored "
        "(did you mean EC_S3_ENDPOINT_URL?)" in log
    )
    assert (
        "WARNING app: EC_S3_ACCESS_KEY_ID is read by docker-compose.yml, not by the server" in log
    )
    assert "AWS_ACCESS_KEY_ID" in log
    assert "WARNING app: EC_SOMETHING_ELSE is not a setting and is ignored\n" in log
    assert "EC_CACHE_URL" not in log


def test_check_passes_for_a_usable_disk_only_configuration(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    done = _app("--check", env={"EC_DATA_DIR": str(data_dir)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        f"ec-cache {__version__}: settings ok",
        f"data directory {data_dir}: ok",
        "S3: not configured (disk only)",
        "configuration ok",
    ]
    assert not (data_dir / "objects").exists()  # checked, not started


def test_check_fails_on_bad_settings(tmp_path: Path) -> None:
    done = _app("--check", env={"EC_DATA_DIR": str(tmp_path), "EC_DISK_MAX_BYTES": "lots"})
    assert done.returncode == 1
    assert "EC_DISK_MAX_BYTES='lots'" in done.stderr


def test_check_fails_on_a_data_dir_in_use_or_in_the_way(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with ServerProcess(data_dir, tmp_path / "log") as srv:
        done = _app("--check", env={"EC_DATA_DIR": str(data_dir)})
        assert done.returncode == 1
        assert f"in use by another ec-cache server (pid {srv.proc.pid}" in done.stdout  # type: ignore[union-attr]
        assert done.stdout.splitlines()[-1] == "configuration NOT ok"
        assert httpx.get(f"{srv.url}/healthz").status_code == 200
    other = tmp_path / "other"
    other.mkdir()
    (other / "objects").write_text("")
    done = _app("--check", env={"EC_DATA_DIR": str(other)})
    assert done.returncode == 1
    assert f"{other / 'objects'} is a plain file" in done.stdout


def test_check_fails_when_s3_is_unreachable(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    done = _app(
        "--check",
        env={
            "EC_DATA_DIR": str(tmp_path),
            "EC_S3_ENDPOINT_URL": endpoint,
            "EC_S3_BUCKET": "b",
            "EC_S3_CONNECT_TIMEOUT": "1",
            "AWS_ACCESS_KEY_ID": "key",
            "AWS_SECRET_ACCESS_KEY": "secret",
        },
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(rf"^S3 {re.escape(endpoint)}: unreachable: ", done.stdout, re.MULTILINE)
