from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from app.settings import Settings, WriteMode, parse_size


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1048576", 1 << 20),
        ("512KiB", 512 << 10),
        ("10GiB", 10 << 30),
        ("3MiB", 3 << 20),
        ("2G", 2 << 30),
        ("1 TiB", 1 << 40),
        (4096, 4096),
    ],
)
def test_sizes(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "ten", "1.5GiB", "-1", "5PB"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_defaults_match_the_design(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("EC_"):
            monkeypatch.delenv(name)
    settings = Settings()
    assert (settings.host, settings.port) == ("127.0.0.1", 8080)
    assert settings.disk_max_bytes == 10 << 30
    assert settings.max_body_bytes == 1 << 30
    assert settings.write_mode is WriteMode.WRITE_THROUGH
    assert not settings.s3_enabled


def test_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EC_DISK_MAX_BYTES", "2GiB")
    monkeypatch.setenv("EC_WRITE_MODE", "write-back")
    monkeypatch.setenv("EC_S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("EC_S3_BUCKET", "ec")
    settings = Settings()
    assert settings.disk_max_bytes == 2 << 30
    assert settings.write_mode is WriteMode.WRITE_BACK
    assert settings.s3_enabled


def test_s3_endpoint_needs_a_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("EC_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("EC_S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    with pytest.raises(ValidationError, match="EC_S3_BUCKET must be set"):
        Settings()
    monkeypatch.setenv("EC_S3_BUCKET", "")  # empty is unset
    with pytest.raises(ValidationError, match="EC_S3_BUCKET must be set"):
        Settings()


def test_bad_value_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EC_PORT", "99999")
    with pytest.raises(ValidationError):
        Settings()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("EC_DISK_MAX_BYTES", "lots"),
        ("EC_PORT", "http"),
        ("EC_WRITE_MODE", "sometimes"),
        ("EC_LOG_LEVEL", "loud"),
    ],
)
def test_start_up_names_the_bad_variable(name: str, value: str) -> None:
    env = {**os.environ, name: value}
    result = subprocess.run(
        [sys.executable, "-m", "app"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert name in result.stderr
    assert "invalid configuration" in result.stderr


def test_connection_and_upload_deadline_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("EC_"):
            monkeypatch.delenv(name)
    s = Settings()
    assert (s.upload_min_rate, s.upload_rate_grace, s.upload_timeout) == (1 << 20, 10.0, 300.0)
    assert (s.max_connections, s.keepalive_timeout) == (4096, 5.0)
    assert (s.header_timeout, s.send_timeout) == (10.0, 30.0)
    monkeypatch.setenv("EC_UPLOAD_MIN_RATE", "256KiB")
    monkeypatch.setenv("EC_UPLOAD_RATE_GRACE", "0")
    assert (Settings().upload_min_rate, Settings().upload_rate_grace) == (256 << 10, 0.0)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("EC_MAX_CONNECTIONS", "0"),
        ("EC_KEEPALIVE_TIMEOUT", "0"),
        ("EC_HEADER_TIMEOUT", "-1"),
        ("EC_SEND_TIMEOUT", "soon"),
        ("EC_UPLOAD_TIMEOUT", "0"),
        ("EC_UPLOAD_MIN_RATE", "fast"),
        ("EC_UPLOAD_RATE_GRACE", "-1"),
    ],
)
def test_bad_deadlines_are_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError):
        Settings()
