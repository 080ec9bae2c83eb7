"""The Dockerfile, .dockerignore and the image's healthcheck script.

No Docker engine here: the Dockerfile is linted (pinned hadolint) and read
instruction by instruction; the healthcheck script runs against real HTTP servers.
"""

from __future__ import annotations

import fnmatch
import http.server
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from testkit.ports import free_port
from tests.deploy.tooling import ROOT, dockerfile_stages, run, server_env_vars, tool

HEALTHCHECK = ROOT / "deploy" / "docker" / "healthcheck.py"


def test_hadolint_clean_at_warning_level() -> None:
    proc = run([tool("hadolint"), "--failure-threshold", "warning", "Dockerfile"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    findings = json.loads(run([tool("hadolint"), "-f", "json", "Dockerfile"]).stdout)
    assert [f for f in findings if f["level"] in {"error", "warning"}] == []


def test_hadolint_would_catch_a_regression(tmp_path: Path) -> None:
    """The lint step is real: an unpinned apt install in the image fails it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        (ROOT / "Dockerfile")
        .read_text()
        .replace(
            "COPY --chmod=0755", "RUN apt-get update && apt-get install -y curl\nCOPY --chmod=0755"
        )
    )
    proc = run([tool("hadolint"), "--failure-threshold", "warning", bad])
    assert proc.returncode != 0
    assert "DL3008" in proc.stdout


def _runtime() -> list[tuple[str, str]]:
    stages = dockerfile_stages()
    runtime = stages[-1]
    assert runtime[0][0] == "FROM" and runtime[0][1].endswith(" AS runtime"), runtime[0]
    return runtime


def _args(instrs: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for instr, arg in instrs:
        if instr == "ARG" and "=" in arg:
            key, value = arg.split("=", 1)
            out[key] = value
    return out


def test_multi_stage_slim_pinned_base() -> None:
    stages = dockerfile_stages()
    header = _args(stages[0])
    base = header["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-bookworm)?(@sha256:[0-9a-f]{64})?", base), base
    froms = [stage[0][1] for stage in stages[1:]]
    assert froms[0] == "${PYTHON_IMAGE} AS builder"
    assert froms[-1] == "${PYTHON_IMAGE} AS runtime"
    assert all("latest" not in f for f in froms)


def test_runtime_stage_has_no_build_tools_or_torch() -> None:
    runtime = _runtime()
    text = "\n".join(f"{i} {a}" for i, a in runtime)
    assert not re.search(r"apt-get|apk |gcc|g\+\+|build-essential|make ", text)
    # The install is the script the builder puts beside the wheels (test_image_install.py
    # runs it): no index, the lock's hashes, and the build proves torch absent.
    assert "sh /wheels/server-wheels.sh install /wheels" in text
    script = (ROOT / "deploy" / "docker" / "server-wheels.sh").read_text()
    install = script[script.index("install)") :]
    assert "--no-index" in install and "--require-hashes" in install
    assert 'python -c "import torch"' in install
    copies = [a for i, a in runtime if i in {"COPY", "ADD"}]
    assert all(i != "ADD" for i, _ in runtime)
    # Only the healthcheck script comes from the build context; the rest from wheels.
    assert copies == [
        "--chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/ec-cache-healthcheck"
    ]
    builder = dockerfile_stages()[1]
    build = [a for i, a in builder if i == "RUN"]
    assert build == ["sh deploy/docker/server-wheels.sh build /wheels"]
    assert "--require-hashes --only-binary=:all:" in script


def test_runtime_stage_user_env_volume_entrypoint() -> None:
    runtime = _runtime()
    args = _args(runtime)
    assert int(args["UID"]) >= 10000 and int(args["GID"]) >= 10000
    users = [a for i, a in runtime if i == "USER"]
    assert users == ["${UID}:${GID}"]
    env = " ".join(a for i, a in runtime if i == "ENV")
    for assignment in ("EC_HOST=0.0.0.0", "EC_PORT=8080", "EC_DATA_DIR=/data"):
        assert assignment in env
    assert [a for i, a in runtime if i == "VOLUME"] == ['["/data"]']
    assert [a for i, a in runtime if i == "EXPOSE"] == ["8080"]
    assert [a for i, a in runtime if i == "ENTRYPOINT"] == ['["python", "-m", "app"]']
    assert [a for i, a in runtime if i == "STOPSIGNAL"] == ["SIGTERM"]
    (health,) = [a for i, a in runtime if i == "HEALTHCHECK"]
    assert health.endswith('CMD ["ec-cache-healthcheck"]')
    labels = " ".join(a for i, a in runtime if i == "LABEL")
    for key in ("title", "description", "version", "revision", "created", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels
    # The USER comes after every RUN: nothing runs as root at container start.
    last_user = max(n for n, (i, _) in enumerate(runtime) if i == "USER")
    assert all(i != "RUN" for i, _ in runtime[last_user:])


def test_image_env_names_are_server_settings() -> None:
    expected = server_env_vars()
    env = " ".join(a for i, a in _runtime() if i == "ENV")
    names = set(re.findall(r"\b(EC_[A-Z0-9_]+)=", env))
    assert names and names <= expected


def _dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        pattern = pattern.rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        if any(
            fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p, pattern.removeprefix("**/"))
            for p in prefixes
        ):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_copy_sources_and_drops_the_rest() -> None:
    sources: list[str] = []
    for stage in dockerfile_stages()[1:]:
        for instr, arg in stage:
            if instr == "COPY" and "--from=" not in arg:
                words = [w for w in shlex.split(arg) if not w.startswith("--")]
                sources += words[:-1]
    assert sources, "no COPY from the build context?"
    for src in sources:
        assert (ROOT / src).exists(), f"COPY source {src} does not exist"
        assert not _dockerignore_excludes(src), f".dockerignore excludes COPY source {src}"
    for private in (
        ".venv/bin/python",
        ".git/HEAD",
        "client/pyproject.toml",
        "bench/x.py",
        ".env",
        "ec-data/x",
        "docs/http-api.md",
        "helm/ec-cache/values.yaml",
        "app/__pycache__/x.pyc",
    ):
        assert _dockerignore_excludes(private), f"{private} would reach the build context"
    assert not _dockerignore_excludes("app/settings.py")


# ------------------------------------------------------------------ healthcheck.py


class _Handler(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        code = self.status if self.path == "/healthz" else 404
        body = b'{"status": "ok"}'
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _serve(status: int) -> Iterator[int]:
    handler = type("H", (_Handler,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def healthy_port() -> Iterator[int]:
    yield from _serve(200)


@pytest.fixture
def failing_port() -> Iterator[int]:
    yield from _serve(503)


def _healthcheck(port: int, host: str = "0.0.0.0") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EC_HOST": host, "EC_PORT": str(port), "EC_HEALTHCHECK_TIMEOUT": "3"}
    return subprocess.run(
        [sys.executable, HEALTHCHECK],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_healthcheck_passes_on_200(healthy_port: int) -> None:
    assert _healthcheck(healthy_port).returncode == 0
    assert _healthcheck(healthy_port, host="127.0.0.1").returncode == 0


def test_healthcheck_fails_on_error_status(failing_port: int) -> None:
    proc = _healthcheck(failing_port)
    assert proc.returncode == 1
    assert "unhealthy" in proc.stderr


def test_healthcheck_fails_when_nothing_listens() -> None:
    port = free_port()
    started = time.monotonic()
    proc = _healthcheck(port)
    assert proc.returncode == 1
    assert time.monotonic() - started < 20


def test_healthcheck_is_stdlib_only() -> None:
    imports = re.findall(r"^(?:import|from) (\w+)", HEALTHCHECK.read_text(), re.MULTILINE)
    assert set(imports) <= {"__future__", "os", "sys", "urllib"}


def test_chart_and_docs_point_at_the_image_this_builds() -> None:
    """One version: the server distribution's, the image's VERSION label, the chart's
    appVersion (its default image tag, repository ``ec-cache``) and the tag the Dockerfile
    and docs/deploy.md build and run."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version
    tag = f"ec-cache:{version.group(1)}"
    assert _args(_runtime())["VERSION"] == version.group(1)
    chart = yaml.safe_load((ROOT / "helm" / "ec-cache" / "Chart.yaml").read_text())
    assert chart["appVersion"] == version.group(1)
    values = yaml.safe_load((ROOT / "helm" / "ec-cache" / "values.yaml").read_text())
    assert (values["image"]["repository"], values["image"]["tag"]) == ("ec-cache", "")
    for doc in ("Dockerfile", "docs/deploy.md"):
        text = (ROOT / doc).read_text()
        assert f"docker build -t {tag}" in text, doc
        assert re.search(rf"docker run [^\n]*(\\\n[^\n]*)*{re.escape(tag)}", text), doc
