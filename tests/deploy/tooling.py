"""Shared helpers for the deployment tests: the pinned tools and chart rendering.

The tools (helm, hadolint, docker-compose, kubernetes-validate) live in the venv that
`deploy/setup.sh` creates (.venv-deploy, or $EC_DEPLOY_VENV). Without it the tests
skip -- except under CI (CI=true), where a missing tool is a failure, so a broken
setup can never turn the deployment checks green by skipping them.
"""

from __future__ import annotations

import ast
import base64
import functools
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.server import SERVER_VENV_PYTHON

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "ec-cache"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
VENV = Path(os.environ.get("EC_DEPLOY_VENV", ROOT / ".venv-deploy"))
RELEASE = "ec"
NAMESPACE = "cache"
FULLNAME = "ec-ec-cache"

Doc = dict[str, Any]


def tool(name: str) -> Path:
    path = VENV / "bin" / name
    if not (path.exists() and os.access(path, os.X_OK)):
        message = f"{path} missing: run `bash deploy/setup.sh` (pinned deployment tools)"
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(message)
        pytest.skip(message)
    return path


def run(args: list[str | Path], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        **kwargs,
    )


class RenderError(Exception):
    pass


@functools.lru_cache(maxsize=64)
def _render_cached(values_json: str, files: tuple[str, ...]) -> str:
    helm = tool("helm")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        fh.write(values_json)  # JSON is YAML
        extra = fh.name
    try:
        args: list[str | Path] = [helm, "template", RELEASE, CHART, "--namespace", NAMESPACE]
        for f in files:
            args += ["--values", f]
        args += ["--values", extra]
        proc = run(args)
    finally:
        os.unlink(extra)
    if proc.returncode != 0:
        raise RenderError(proc.stderr.strip())
    return proc.stdout


def render_text(values: dict[str, Any] | None = None, files: Iterable[Path] = ()) -> str:
    return _render_cached(json.dumps(values or {}, sort_keys=True), tuple(str(f) for f in files))


def render(values: dict[str, Any] | None = None, files: Iterable[Path] = ()) -> list[Doc]:
    return [d for d in yaml.safe_load_all(render_text(values, files)) if d]


def render_error(values: dict[str, Any]) -> str:
    try:
        render_text(values)
    except RenderError as err:
        return str(err)
    raise AssertionError(f"helm template accepted values it should reject: {values}")


def find(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def workload(docs: list[Doc]) -> Doc:
    found = [d for d in docs if d["kind"] in {"StatefulSet", "Deployment"}]
    assert len(found) == 1, [d["kind"] for d in found]
    return found[0]


def pod_spec(docs: list[Doc]) -> dict[str, Any]:
    spec: dict[str, Any] = workload(docs)["spec"]["template"]["spec"]
    return spec


def container(docs: list[Doc]) -> dict[str, Any]:
    containers = pod_spec(docs)["containers"]
    assert [c["name"] for c in containers] == ["ec-cache"]
    c: dict[str, Any] = containers[0]
    return c


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def server_env_vars() -> set[str]:
    """EC_* names the server reads, from app/settings.py (parsed, not imported)."""
    path = ROOT / "app" / "settings.py"
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Settings":
            prefix = "EC_"
            src = ast.get_source_segment(path.read_text(), node) or ""
            m = re.search(r"env_prefix\s*=\s*[\"']([^\"']+)[\"']", src)
            if m:
                prefix = m.group(1)
            return {
                prefix + stmt.target.id.upper()
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and not stmt.target.id.startswith("_")
                and stmt.target.id != "model_config"
            }
    raise AssertionError(f"no Settings class in {path}")


def server_default(name: str) -> Any:
    """The default of the server setting ``name`` (``EC_SHUTDOWN_TIMEOUT``), from
    app/settings.py (parsed, not imported): a literal ``default=`` or plain value."""
    path = ROOT / "app" / "settings.py"
    field = name.removeprefix("EC_").lower()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == field
            and node.value is not None
        ):
            value = node.value
            if isinstance(value, ast.Call):
                value = next(k.value for k in value.keywords if k.arg == "default")
            return ast.literal_eval(value)
    raise AssertionError(f"no setting {name} in {path}")


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """Dockerfile as stages of (INSTRUCTION, arguments), continuation lines joined."""
    lines: list[str] = []
    buf = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append(buf + stripped)
        buf = ""
    stages: list[list[tuple[str, str]]] = [[]]
    for line in lines:
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            stages.append([])
        stages[-1].append((instr, rest.strip()))
    return stages


def require_server_venv() -> None:
    """Skip (fail in CI) a test that runs the server when its venv is missing."""
    if "EC_SERVER_PYTHON" not in os.environ and not SERVER_VENV_PYTHON.exists():
        message = f"{SERVER_VENV_PYTHON} missing: the server's venv (make test creates .venv)"
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(message)
        pytest.skip(message)
