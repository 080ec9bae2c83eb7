"""The protocol adapter's versions are the lock's, and this venv runs the adapter."""

from __future__ import annotations

from packaging.version import Version

from app.http_protocol import LOCKED, unlocked_versions
from tests.unit.test_dependencies import locked


def test_adapter_versions_are_the_locked_ones() -> None:
    """`make lock` moved uvicorn or httptools: check app/http_protocol against the new
    release (its private parts), then update ``LOCKED``."""
    pins = locked()
    assert {name: Version(v) for name, v in LOCKED.items()} == {name: pins[name] for name in LOCKED}


def test_the_suite_runs_the_adapter() -> None:
    assert unlocked_versions() == {}
