"""The image's install steps, run for real: what `docker build` would do, without a
Docker engine (there is none here).

The builder stage's step (``deploy/docker/server-wheels.sh build``: the locked wheels,
hash-checked, and the server's own) runs into a fresh folder; the final stage's step
(``... install``: no index, hashes required, then the image's own checks) into a fresh
venv. The server then starts as the ENTRYPOINT starts it, from the image's working
directory with the image's environment (loopback instead of 0.0.0.0 and a free port:
nothing here listens beyond this machine), and a 4.7 MB entry round-trips; the
HEALTHCHECK command runs against it. The documented ``docker run`` line's settings
must pass the server's start-up checks. Last, the test stage is installed on top, as
the Dockerfile does, and every test module the compose file's ``s3-tests`` service runs
must import there.

What this cannot check: the base image itself, BuildKit's mounts, the non-root user
and file modes, the read-only root file system; hadolint and the tests in
test_deploy_image.py read those instructions instead.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from testkit.server import ServerProcess
from tests.deploy.tooling import ROOT, dockerfile_stages

SCRIPT = ROOT / "deploy" / "docker" / "server-wheels.sh"
# The image's HEALTHCHECK runs this file, copied to /usr/local/bin/ec-cache-healthcheck.
HEALTHCHECK = ROOT / "deploy" / "docker" / "healthcheck.py"


@dataclass
class Image:
    """The installed "image": a venv, its PATH, and the runtime stage's instructions."""

    venv: Path
    wheels: Path
    env: dict[str, str]  # the runtime stage's ENV, PATH first to the venv
    entrypoint: list[str]
    workdir: Path  # the image's WORKDIR (/data): the server must not import from ROOT


def _instructions(stage: str) -> list[tuple[str, str]]:
    for instructions in dockerfile_stages()[1:]:
        if instructions[0][1].endswith(f" AS {stage}"):
            return instructions
    raise AssertionError(f"no {stage} stage in the Dockerfile")


def _image_env(runtime: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instr, arg in runtime:
        if instr == "ENV":
            for part in shlex.split(arg):
                name, _, value = part.partition("=")
                env[name] = value
    return env


def _run(args: list[str], *, env: dict[str, str], cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run(
        args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    root = tmp_path_factory.mktemp("image")
    runtime = _instructions("runtime")
    builder = " ".join(arg for instr, arg in _instructions("builder") if instr == "RUN")
    final = " ".join(arg for instr, arg in runtime if instr == "RUN")
    assert "server-wheels.sh build /wheels" in builder
    assert "server-wheels.sh install /wheels" in final
    # Builder stage: wheels from the lock, with this interpreter as the image's python.
    wheels = root / "wheels"
    build_env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    _run(["sh", str(SCRIPT), "build", str(wheels)], env=build_env, cwd=ROOT)
    # Final stage: a fresh venv, the script the builder put beside the wheels.
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=True)
    image_env = _image_env(runtime)
    path = f"{env_dir / 'bin'}:/usr/bin:/bin"
    clean = {"PATH": path, "HOME": str(root), "LANG": "C.UTF-8"}
    _run(["sh", str(wheels / "server-wheels.sh"), "install", str(wheels)], env=clean, cwd=root)
    workdir = root / "data"
    workdir.mkdir()
    (entrypoint,) = [json.loads(arg) for instr, arg in runtime if instr == "ENTRYPOINT"]
    return Image(env_dir, wheels, {**image_env, **clean}, entrypoint, workdir)


def test_the_image_installs_exactly_the_lock(image: Image) -> None:
    listed = _run(
        ["python", "-m", "pip", "list", "--format=json"], env=image.env, cwd=image.workdir
    )
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(listed)}
    lock = (ROOT / "requirements.lock").read_text()
    locked = {m.lower() for m in re.findall(r"^([A-Za-z0-9_.-]+)==", lock, re.MULTILINE)}
    assert "torch" not in installed
    assert locked <= installed
    extra = installed - locked - {"ec-cache-server", "pip", "setuptools", "wheel"}
    assert extra == set(), "installed beyond the lock"


def test_the_servers_wheel_is_built_by_the_locked_backend(image: Image) -> None:
    """Not by whatever setuptools an isolated build fetched that day: the one pinned,
    with hashes, in deploy/docker/build-backend.lock, which satisfies pyproject's
    ``build-system.requires``."""
    lock = (ROOT / "deploy" / "docker" / "build-backend.lock").read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\$", lock, re.MULTILINE))
    assert pins.keys() == {"setuptools"}, pins
    assert lock.count("--hash=sha256:") >= len(pins)
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    for requirement in map(Requirement, requires):
        assert requirement.specifier.contains(pins[requirement.name]), requirement
    (wheel,) = image.wheels.glob("ec_cache_server-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/WHEEL")]
        metadata = archive.read(name).decode()
    assert f"Generator: setuptools ({pins['setuptools']})" in metadata, metadata


def _entry_body() -> bytes:
    """A 4.7 MB bfloat16 entry (576 x 4096, a LLaVA-1.5 image) as a safetensors file."""
    nbytes = 576 * 4096 * 2
    header = json.dumps(
        {"embedding": {"dtype": "BF16", "shape": [576, 4096], "data_offsets": [0, nbytes]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    data = bytes(range(256)) * (nbytes // 256)
    return struct.pack("<Q", len(header)) + header + data


@pytest.fixture(scope="module")
def server(image: Image) -> Iterator[dict[str, str]]:
    """The ENTRYPOINT in the image's environment and WORKDIR, at the image's log level."""
    with ServerProcess(
        image.workdir,
        image.workdir.parent / "server.log",
        command=image.entrypoint,
        env=image.env,
        cwd=image.workdir,
        log_level=image.env.get("EC_LOG_LEVEL", "info"),
    ) as srv:
        yield srv.env


def test_the_entrypoint_serves_a_4_7_mb_entry(image: Image, server: dict[str, str]) -> None:
    data = _entry_body()
    path = "/ec/llava-hf/llava-1.5-7b-hf/bfloat16/image-check"
    conn = http.client.HTTPConnection("127.0.0.1", int(server["EC_PORT"]), timeout=30)
    try:
        conn.request("PUT", path, body=data)
        put = conn.getresponse()
        assert put.status == 201, put.read()
        put.read()
        conn.request("HEAD", path)
        head = conn.getresponse()
        head.read()
        assert head.status == 200
        assert head.getheader("content-length") == str(len(data))
        assert head.getheader("x-ec-shape") == "576,4096"
        conn.request("GET", path)
        get = conn.getresponse()
        assert get.status == 200
        assert get.read() == data
    finally:
        conn.close()
    # The server ran the installed wheel, not the repository's app/.
    log = (image.workdir.parent / "server.log").read_text()
    assert str(ROOT) not in log


def test_the_healthcheck_passes(image: Image, server: dict[str, str]) -> None:
    (health,) = [arg for instr, arg in _instructions("runtime") if instr == "HEALTHCHECK"]
    assert health.endswith('CMD ["ec-cache-healthcheck"]')
    _run(["python", str(HEALTHCHECK)], env=server, cwd=image.workdir)


def _documented_docker_run() -> list[str]:
    """The ``docker run`` line at the top of the Dockerfile, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text()
    match = re.search(r"^#\s+(docker run .*?)$(?!\n#\s{3,})", text, re.MULTILINE | re.DOTALL)
    assert match, "no docker run example in the Dockerfile"
    joined = re.sub(r"\\\n#\s*", " ", match.group(1))
    return shlex.split(joined)


def _starts(image: Image, extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The server's start-up checks (settings, then the app), without listening."""
    check = (
        "from app.main import create_app; from app.settings import Settings; create_app(Settings())"
    )
    env = {**image.env, "EC_DATA_DIR": str(image.workdir), **extra}
    return subprocess.run(
        ["python", "-c", check],
        env=env,
        cwd=image.workdir,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_documented_docker_run_starts(image: Image) -> None:
    words = _documented_docker_run()
    settings = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "-e")
    assert _image_env(_instructions("runtime"))["EC_HOST"] == "0.0.0.0"
    started = _starts(image, settings)
    assert started.returncode == 0, started.stderr
    # The same image without them refuses to start: the check above can fail.
    refused = _starts(image, {})
    assert refused.returncode != 0
    assert "EC_ANONYMOUS" in refused.stderr or "EC_AUTH_TOKENS" in refused.stderr


def test_the_compose_test_profile_collects_in_the_test_stage(image: Image) -> None:
    """The ``test`` stage: the runtime install, then ``pip install ".[test]"`` in the
    builder's /src (pyproject, README, lock, app/) with testkit/ and tests/ copied in; the
    ``s3-tests`` service's command must collect every module without an import error."""
    stage = _instructions("test")
    runs = " ".join(arg for instr, arg in stage if instr == "RUN")
    assert 'pip install ".[test]"' in runs
    src = image.workdir.parent / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "requirements.lock"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("app", "testkit", "tests"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    _run(["python", "-m", "pip", "install", "--quiet", ".[test]"], env=image.env, cwd=src)
    (entrypoint,) = [json.loads(arg) for instr, arg in stage if instr == "ENTRYPOINT"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command = compose["services"]["s3-tests"]["command"]
    collected = _run(
        [*entrypoint, *command, "--collect-only", "-p", "no:cacheprovider"],
        env={**image.env, "CI": "true"},
        cwd=src,
    )
    assert re.search(r"\d+ tests? collected", collected), collected
    assert "error" not in collected.lower().splitlines()[-1], collected
