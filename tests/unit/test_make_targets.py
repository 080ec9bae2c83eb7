"""The Makefile and the scripts it runs do what README.md and `make help` say: every
target is listed, `system-deps` installs what is missing, the later venvs take torch
from ``TORCH_INDEX``. Run with stand-ins for apt-get and pip that record their calls."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make") or "make"


def recorder(path: Path, log: Path, status: int = 0) -> None:
    """An executable at ``path`` that appends its arguments to ``log``, exits ``status``."""
    path.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexit {status}\n')
    path.chmod(0o755)


def test_make_help_lists_every_target() -> None:
    makefile = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY: (.*)$", makefile, re.MULTILINE)
    assert phony is not None
    listed = subprocess.run(
        [MAKE, "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    documented = {line.split(":", 1)[0] for line in listed.splitlines() if ":" in line}
    assert set(phony.group(1).split()) - documented == set()
    for target in ("check", "typecheck", "bench-quick", "clean"):
        assert target in documented


def test_system_deps_installs_what_is_missing(tmp_path: Path) -> None:
    """With neither nginx nor npm on PATH, one apt-get install of both, as the README's
    first screen says `make test` does."""
    log = tmp_path / "apt.log"
    recorder(tmp_path / "apt-get", log)
    env = {**os.environ, "PATH": str(tmp_path)}
    # The recipe also finds Debian's nginx at /usr/sbin/nginx, off PATH.
    expected = ["npm"] if Path("/usr/sbin/nginx").exists() else ["nginx", "npm"]
    result = subprocess.run(
        [MAKE, "--no-print-directory", "system-deps"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "update -qq"
    assert calls[1].split()[-len(expected) :] == expected
    assert calls[1].startswith("install -y -qq ")
    readme = (ROOT / "README.md").read_text()
    assert "needs Debian's `nginx` and\n`npm` (it installs them with apt" in readme


def test_venv_lib_takes_torch_from_torch_index(tmp_path: Path) -> None:
    """scripts/venv-lib.sh (the later venvs' torch) honours TORCH_INDEX as `make sdk`
    does, and asks PyPI without it."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "python.log"
    recorder(venv / "bin" / "python", log, status=1)  # `have torch`: not installed
    index = "https://download.pytorch.org/whl/cpu"
    for torch_index, expected in [(index, f" --index-url {index}"), ("", "")]:
        log.unlink(missing_ok=True)
        env = {
            **os.environ,
            "ROOT": str(ROOT),
            "VENV": str(venv),
            "NAME": "test",
            "TORCH_VERSION": "2.13.0",
            "TORCH_INDEX": torch_index,
        }
        subprocess.run(
            ["bash", "-c", 'source "$ROOT/scripts/venv-lib.sh" || true'],
            env=env,
            capture_output=True,
            check=True,
        )
        installs = [line for line in log.read_text().splitlines() if "pip install" in line]
        assert installs == [
            f"-m pip install --disable-pip-version-check --quiet torch==2.13.0{expected}"
        ]
