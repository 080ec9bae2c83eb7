"""The server's declared dependencies are what CI tests and the image ships.

requirements.lock is the runtime tree (`make lock`); pyproject.toml's ranges start at
the locked versions, so no untested older release is admitted; and this venv, where the
suite runs, holds exactly the locked versions (the test tools installed after them must
not have moved any).
"""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def locked() -> dict[str, Version]:
    """``{name: version}`` of every requirement in requirements.lock that applies here."""
    pins: dict[str, Version] = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^ ;\\]+)\s*(?:;([^\\]*))?", line)
        if match is None:
            continue
        name, pinned, marker = match.groups()
        if marker and not Marker(marker).evaluate():
            continue
        pins[canonicalize_name(name)] = Version(pinned)
    return pins


def test_the_lock_pins_every_direct_dependency_with_hashes() -> None:
    text = (ROOT / "requirements.lock").read_text()
    pins = locked()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dependency in project["dependencies"]:
        assert canonicalize_name(Requirement(dependency).name) in pins, dependency
    blocks = re.split(r"\n(?=[A-Za-z])", text.split("\n", 2)[2])
    assert all("--hash=sha256:" in block for block in blocks if "==" in block)


def test_this_venv_holds_exactly_the_locked_versions() -> None:
    wrong = {}
    for name, pinned in locked().items():
        try:
            installed = Version(version(name))
        except PackageNotFoundError:
            wrong[name] = ("missing", str(pinned))
            continue
        if installed != pinned:
            wrong[name] = (str(installed), str(pinned))
    assert wrong == {}, "installed != locked (make .venv again, or make lock)"


def test_declared_ranges_start_at_the_locked_versions() -> None:
    """Narrowed to what is tested: each direct dependency's lowest admitted version is
    the locked one (`make lock` moved a version: raise its floor in pyproject.toml)."""
    pins = locked()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dependency in project["dependencies"]:
        requirement = Requirement(dependency)
        floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
        assert len(floors) == 1, f"{dependency}: one >= bound expected"
        pinned = pins[canonicalize_name(requirement.name)]
        assert pinned in requirement.specifier, f"{dependency} excludes the locked {pinned}"
        assert floors[0].release == pinned.release[: len(floors[0].release)], (
            f"{dependency}: the floor is not the locked {pinned}"
        )


def test_the_deploy_guide_names_the_locked_versions() -> None:
    """docs/deploy.md says which versions the image ships: they must be the lock's."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text[text.index("### What the image ships") : text.index("### Upgrading")]
    pins = locked()
    named = re.findall(r"([A-Za-z][A-Za-z0-9_.-]*)(?:/[A-Za-z0-9_.-]+)?\s+(\d+\.\d+\.\d+)", section)
    assert len(named) >= 8, named
    for name, stated in named:
        assert pins[canonicalize_name(name)] == Version(stated), f"{name} {stated}"
