"""The ``ec-cache`` command line, run as a subprocess (``python -m ec_cache``) against a
real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import ec_cache
import httpx
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from testkit.ports import free_port
from testkit.server import ServerProcess

from .conftest import CLIENT_DIR


def run(
    server: ServerProcess | None,
    *args: str,
    model: str = "cli/model",
    dtype: str | None = "float32",
    env: dict[str, str] | None = None,
    python_flags: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, PYTHONPATH=str(CLIENT_DIR), **(env or {}))
    for name in ("EC_CACHE_URL", "EC_CACHE_MODEL", "EC_CACHE_DTYPE", "EC_CACHE_TOKEN"):
        if not env or name not in env:
            full_env.pop(name, None)
    argv = [sys.executable, *python_flags, "-m", "ec_cache"]
    if server is not None:
        argv += ["--url", server.url]
    if model:
        argv += ["--model", model]
    if dtype:
        argv += ["--dtype", dtype]
    return subprocess.run([*argv, *args], capture_output=True, text=True, env=full_env, timeout=120)


def key() -> str:
    return uuid.uuid4().hex


def test_help_lists_commands_and_exit_codes() -> None:
    result = run(None, "--help", model="", dtype=None)
    assert result.returncode == 0
    for word in ["head", "get", "put", "rm", "exists", "stats", "exit status", "EC_CACHE_URL"]:
        assert word in result.stdout


def test_version_is_the_sdks() -> None:
    result = run(None, "--version", model="", dtype=None)
    assert (result.returncode, result.stdout) == (0, f"ec-cache {ec_cache.__version__}\n")


def imported_modules(stderr: str) -> set[str]:
    """The modules a ``python -X importtime`` process imported, from its stderr."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


@pytest.mark.parametrize(
    "command",
    [
        ["--help"],
        ["--version"],
        ["head", "HASH"],
        ["exists", "HASH"],
        ["ls"],
        ["du"],
        ["stats"],
        ["get", "HASH", "-o", os.devnull],
    ],
)
def test_only_commands_that_move_a_tensor_import_torch(
    server: ServerProcess, command: list[str]
) -> None:
    """torch takes seconds to import: ``--help``, ``head``, ``exists``, ``ls``, ``du``
    and ``stats`` must run without it; ``get`` shows that the check sees the import."""
    h = key()
    tensor = np.arange(6, dtype=np.float32)
    with httpx.Client() as http:
        body = safetensors.numpy.save({"tensor": tensor})
        assert http.put(f"{server.url}/ec/cli/model/float32/{h}", content=body).status_code == 201
    args = [h if arg == "HASH" else arg for arg in command]
    result = run(server, *args, python_flags=("-X", "importtime"))
    assert result.returncode == 0, result.stderr[-2000:]
    modules = imported_modules(result.stderr)
    assert "ec_cache._cli" in modules  # the check reads the real import list
    torch_modules = sorted(m for m in modules if m == "torch" or m.startswith("torch."))
    if command[0] == "get":
        assert "torch" in torch_modules
    else:
        assert torch_modules == [], f"{command[0]} imported {torch_modules[:5]}"


def test_put_safetensors_head_get_rm(server: ServerProcess, tmp_path: Path) -> None:
    t = torch.randn(12, 34).to(torch.bfloat16)
    src = tmp_path / "in.safetensors"
    safetensors.torch.save_file({"whatever": t}, src)
    h = key()
    result = run(server, "put", str(src), h, dtype=None)  # dtype from the file
    assert result.returncode == 0, result.stderr
    assert "created" in result.stdout
    assert "already present" in run(server, "put", str(src), h, dtype=None).stdout

    result = run(server, "head", h, dtype="bfloat16")
    assert result.returncode == 0 and "12 x 34" in result.stdout and "bfloat16" in result.stdout
    info = json.loads(run(server, "info", h, "--json", dtype="bfloat16").stdout)
    assert info["shape"] == [12, 34] and info["present"] is True and info["tier"] == "disk"

    out = tmp_path / "out.safetensors"
    result = run(server, "get", h, "-o", str(out), dtype="bfloat16")
    assert result.returncode == 0, result.stderr
    assert torch.equal(safetensors.torch.load_file(out)["tensor"], t)

    pt = tmp_path / "out.pt"
    assert run(server, "get", h, "-o", str(pt), dtype="bfloat16").returncode == 0
    assert torch.equal(torch.load(pt), t)

    assert run(server, "rm", h, dtype="bfloat16").returncode == 0
    result = run(server, "head", h, dtype="bfloat16")
    assert result.returncode == 1 and "not found" in result.stdout
    assert run(server, "get", h, "-o", str(out), dtype="bfloat16").returncode == 1


def test_put_npy_and_pt(server: ServerProcess, tmp_path: Path) -> None:
    arr = np.arange(20, dtype=np.int32).reshape(4, 5)
    np.save(tmp_path / "a.npy", arr)
    h = key()
    assert run(server, "put", str(tmp_path / "a.npy"), h, dtype=None).returncode == 0
    assert run(server, "get", h, "-o", str(tmp_path / "b.npy"), dtype="int32").returncode == 0
    assert (np.load(tmp_path / "b.npy") == arr).all()

    torch.save({"x": torch.ones(3, 3)}, tmp_path / "c.pt")
    h2 = key()
    # --dtype --convert converts: a float32 file stored as float16
    put = run(server, "put", str(tmp_path / "c.pt"), h2, "--convert", dtype="float16")
    assert put.returncode == 0
    assert "float16" in run(server, "head", h2, dtype="float16").stdout


def test_put_refuses_another_dtype_than_the_files(server: ServerProcess, tmp_path: Path) -> None:
    """A float16 .npy under --dtype bfloat16 (or $EC_CACHE_DTYPE) is refused, not cast,
    and nothing is stored; --dtype float16 stores it as it is."""
    np.save(tmp_path / "half.npy", np.ones((3, 4), dtype=np.float16))
    h = key()
    refused = run(server, "put", str(tmp_path / "half.npy"), h, dtype="bfloat16")
    assert refused.returncode == 2, refused.stdout
    assert "holds float16, but --dtype (or $EC_CACHE_DTYPE) is bfloat16" in refused.stderr
    assert "--convert" in refused.stderr
    env = {"EC_CACHE_DTYPE": "bfloat16"}
    from_env = run(server, "put", str(tmp_path / "half.npy"), h, dtype=None, env=env)
    assert from_env.returncode == 2 and "--convert" in from_env.stderr
    for dtype in ("bfloat16", "float16"):
        assert run(server, "head", h, dtype=dtype).returncode == 1  # nothing stored
    assert run(server, "put", str(tmp_path / "half.npy"), h, dtype="float16").returncode == 0
    assert "float16" in run(server, "head", h, dtype="float16").stdout


def test_get_to_stdout(server: ServerProcess, tmp_path: Path) -> None:
    h = key()
    np.save(tmp_path / "a.npy", np.ones((2, 2), dtype=np.float32))
    run(server, "put", str(tmp_path / "a.npy"), h)
    full_env = dict(os.environ, PYTHONPATH=str(CLIENT_DIR))
    raw = subprocess.run(
        [
            sys.executable,
            "-m",
            "ec_cache",
            "--url",
            server.url,
            "--model",
            "cli/model",
            "--dtype",
            "float32",
            "get",
            h,
            "-o",
            "-",
        ],
        capture_output=True,
        env=full_env,
        timeout=60,
    )
    assert raw.returncode == 0
    assert torch.equal(safetensors.torch.load(raw.stdout)["tensor"], torch.ones(2, 2))


def test_exists_batch_and_exit_code(server: ServerProcess, tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.zeros(3, dtype=np.float32))
    h = key()
    run(server, "put", str(tmp_path / "a.npy"), h)
    result = run(server, "exists", h, "absent-1", "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout) == {h: True, "absent-1": False}
    result = run(server, "exists", h)
    assert result.returncode == 0 and f"{h}: present" in result.stdout


def test_stats(server: ServerProcess) -> None:
    result = run(server, "stats", model="", dtype=None)
    assert result.returncode == 0 and "disk.entries" in result.stdout
    data = json.loads(run(server, "stats", "--json", model="", dtype=None).stdout)
    assert "disk" in data[server.url]


def test_environment_defaults(server: ServerProcess, tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.zeros(3, dtype=np.float32))
    env = {"EC_CACHE_URL": server.url, "EC_CACHE_MODEL": "env/model", "EC_CACHE_DTYPE": "float32"}
    h = key()
    assert (
        run(None, "put", str(tmp_path / "a.npy"), h, model="", dtype=None, env=env).returncode == 0
    )
    assert run(None, "head", h, model="", dtype=None, env=env).returncode == 0
    # options after the command override the environment
    assert (
        run(None, "head", h, "--model", "other/model", model="", dtype=None, env=env).returncode
        == 1
    )


def test_usage_and_error_exit_codes(server: ServerProcess, tmp_path: Path) -> None:
    assert run(server, "head").returncode == 2  # missing HASH
    assert run(server, "head", "bad/hash").returncode == 2
    assert run(server, "head", "h", model="").returncode == 2  # no model
    assert run(server, "put", str(tmp_path / "missing.npy"), "h").returncode == 2
    (tmp_path / "x.txt").write_text("hi")
    assert run(server, "put", str(tmp_path / "x.txt"), "h").returncode == 2
    refused = run(None, "--url", f"http://127.0.0.1:{free_port()}", "--retries", "1", "head", "h")
    assert refused.returncode == 3 and "connect" in refused.stderr.lower()


@pytest.mark.parametrize("progress", ["always", "never"])
def test_progress_on_stderr(server: ServerProcess, tmp_path: Path, progress: str) -> None:
    t = torch.randn(3000, 1024)  # 12 MB
    safetensors.torch.save_file({"t": t}, tmp_path / "big.safetensors")
    h = key()
    result = run(server, "--progress", progress, "put", str(tmp_path / "big.safetensors"), h)
    assert result.returncode == 0
    assert ("MiB" in result.stderr) == (progress == "always")
    result = run(server, "get", h, "-o", str(tmp_path / "o.safetensors"), "--progress", progress)
    assert result.returncode == 0 and ("100.0%" in result.stderr) == (progress == "always")


def test_503_is_an_outage_not_a_miss(make_server: Any) -> None:
    """A server whose S3 tier is unreachable answers 503 for what its disk lacks:
    ``head``, ``get`` and ``exists`` say the server is unavailable and exit 3 (a miss
    exits 1), while the SDK's default client still reads it as a miss."""
    dead = f"http://127.0.0.1:{free_port()}"
    # Credentials present (so the tier is configured), endpoint refusing connections.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "ec-cache-test")
        env.setenv("AWS_SECRET_ACCESS_KEY", "ec-cache-test-secret")
        srv = make_server(s3_endpoint_url=dead, s3_bucket="b")
    h = key()
    for args in (["head", h], ["get", h, "-o", os.devnull], ["exists", h]):
        result = run(srv, *args)
        assert result.returncode == 3, (args, result.stdout, result.stderr)
        assert "server unavailable (HTTP 503 from " in result.stderr, result.stderr
        assert "not found" not in result.stdout + result.stderr
        assert "absent" not in result.stdout
    with ec_cache.Client(srv.url, model="cli/model", dtype="float32") as client:
        assert client.head(h) is None and client.exists_many([h]) == [False]


def test_forbidden_head_names_the_missing_scope(tmp_path: Path) -> None:
    """A HEAD answer has no body: the server puts its error in ``X-EC-Error``, and the
    CLI says which scope or model the token lacks (not "no error body")."""
    tokens = "writer:write:" + "w" * 20 + ";other:read,model=other/**:" + "o" * 20
    with ServerProcess(tmp_path / "data", tmp_path / "log", auth_tokens=tokens) as srv:
        answer = httpx.head(
            f"{srv.url}/ec/cli/model/float32/{key()}",
            headers={"Authorization": "Bearer " + "w" * 20},
        )
        assert answer.status_code == 403
        assert answer.headers["x-ec-error"] == "forbidden: token 'writer' lacks the read scope"
        for token, reason in [
            ("w" * 20, "token 'writer' lacks the read scope"),
            ("o" * 20, "token 'other' may not access model 'cli/model'"),
        ]:
            result = run(srv, "head", key(), env={"EC_CACHE_TOKEN": token})
            assert result.returncode == 3
            assert result.stderr == f"ec-cache: HTTP 403 forbidden: {reason}\n"


@pytest.mark.parametrize("command", [["head", "abc"], ["ls"]])
def test_base_url_ending_in_ec_is_refused(server: ServerProcess, command: list[str]) -> None:
    """``--url http://host:port/ec`` would store under model ``ec/...``: refused,
    naming the URL to give instead."""
    result = run(None, "--url", server.url + "/ec/", *command)
    assert result.returncode == 2
    assert f"server URL '{server.url}/ec' ends in /ec: give the server's base URL " in result.stderr
    assert f"('{server.url}')" in result.stderr
    with pytest.raises(ValueError, match="ends in /ec"):
        ec_cache.Client(server.url + "/ec", model="m", dtype="float32")
