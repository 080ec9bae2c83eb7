"""The botocore adapter's version is the lock's, and this venv runs the adapter."""

from __future__ import annotations

from packaging.version import Version

from app.tiers.s3.botocore_adapter import LOCKED, installed
from tests.unit.test_dependencies import locked


def test_adapter_version_is_the_locked_one() -> None:
    """`make lock` moved botocore: check the S3 data plane's modules (signing,
    http_session, signed_http, loop_get) against it, then update LOCKED."""
    assert Version(LOCKED) == locked()["botocore"]


def test_the_suite_runs_the_adapter() -> None:
    assert installed() == LOCKED
