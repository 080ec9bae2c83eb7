"""docker-compose.yml, as the pinned Compose CLI resolves it (no engine needed)."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from tests.deploy.tooling import ROOT, run, server_default, server_env_vars, tool


@cache
def config(profile: str | None = None) -> dict[str, Any]:
    args: list[str | Path] = [tool("docker-compose"), "-f", ROOT / "docker-compose.yml"]
    if profile:
        args += ["--profile", profile]
    proc = run([*args, "config", "--format", "json"])
    assert proc.returncode == 0, proc.stderr
    parsed: dict[str, Any] = json.loads(proc.stdout)
    return parsed


def test_compose_config_is_accepted() -> None:
    for extra in ([], ["--profile", "test"]):
        proc = run(
            [tool("docker-compose"), "-f", ROOT / "docker-compose.yml", *extra, "config", "--quiet"]
        )
        assert proc.returncode == 0, proc.stderr


def test_compose_would_catch_a_regression(tmp_path: Path) -> None:
    """The config check is real: a dependency on an unknown service is rejected."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        (ROOT / "docker-compose.yml")
        .read_text()
        .replace(
            "      minio-init:\n        condition: service_completed_successfully",
            "      minio-setup:\n        condition: service_completed_successfully",
            1,
        )
    )
    proc = run([tool("docker-compose"), "-f", broken, "config", "--quiet"])
    assert proc.returncode != 0
    assert "minio-setup" in proc.stderr


def test_services_and_profiles() -> None:
    assert set(config()["services"]) == {"minio", "minio-init", "ec-cache"}
    assert set(config("test")["services"]) == {"minio", "minio-init", "ec-cache", "s3-tests"}
    assert config("test")["services"]["s3-tests"]["profiles"] == ["test"]


def test_images_are_pinned_releases() -> None:
    services = config()["services"]
    assert re.fullmatch(
        r"(quay\.io/)?minio/minio:RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ",
        services["minio"]["image"],
    )
    assert re.fullmatch(
        r"(quay\.io/)?minio/mc:RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ",
        services["minio-init"]["image"],
    )


def test_startup_is_gated_on_health() -> None:
    services = config("test")["services"]
    assert services["minio"]["healthcheck"]["test"][:2] == ["CMD", "mc"]
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    for name in ("ec-cache", "s3-tests"):
        deps = services[name]["depends_on"]
        assert deps["minio"]["condition"] == "service_healthy"
        assert deps["minio-init"]["condition"] == "service_completed_successfully"
    assert services["ec-cache"]["healthcheck"]["test"] == ["CMD", "ec-cache-healthcheck"]


def test_ec_cache_service_wiring_and_hardening() -> None:
    svc = config()["services"]["ec-cache"]
    assert svc["build"]["target"] == "runtime"
    assert svc["build"]["dockerfile"] == "Dockerfile"
    env = svc["environment"]
    assert env["EC_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert env["EC_S3_BUCKET"] and env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]
    # The cache gets its own MinIO user, never the root credentials.
    minio_env = config()["services"]["minio"]["environment"]
    assert env["AWS_ACCESS_KEY_ID"] != minio_env["MINIO_ROOT_USER"]
    assert [(v["source"], v["target"]) for v in svc["volumes"]] == [("ec-data", "/data")]
    assert "ec-data" in config()["volumes"]
    assert svc["read_only"] is True
    assert svc["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in svc["security_opt"]
    assert all(p["host_ip"] == "127.0.0.1" for p in svc["ports"])
    assert svc["ports"][0]["target"] == 8080


def test_compose_env_names_are_server_settings() -> None:
    expected = server_env_vars()
    names = {n for n in config()["services"]["ec-cache"]["environment"] if n.startswith("EC_")}
    assert names <= expected, sorted(names - expected)


def test_s3_tests_service_matches_the_suite() -> None:
    svc = config("test")["services"]["s3-tests"]
    assert svc["build"]["target"] == "test"
    env = svc["environment"]
    assert env["EC_TEST_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]
    assert svc["command"][-1] == "tests/s3"
    init = config()["services"]["minio-init"]
    script = " ".join(init["command"])
    assert "$$EC_TEST_S3_BUCKET" in script or "$EC_TEST_S3_BUCKET" in script
    assert init["environment"]["EC_TEST_S3_BUCKET"] == env["EC_TEST_S3_BUCKET"]
    # Every EC_TEST_S3_* variable the suite reads is provided.
    read = set()
    for py in (ROOT / "tests" / "s3").glob("*.py"):
        read |= set(re.findall(r"\b(EC_TEST_S3_[A-Z_]+)\b", py.read_text()))
    assert read, "tests/s3 reads no EC_TEST_S3_* variable?"
    assert read <= set(env), sorted(read - set(env))


def _seconds(duration: str) -> float:
    """A Compose duration (``45s``, ``1m30s``) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"([0-9.]+)(ms|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_stop_grace_period_covers_the_drains_in_either_write_mode() -> None:
    """The grace rule of docs/deploy.md: after SIGTERM the server drains requests for
    EC_SHUTDOWN_TIMEOUT, then (write-back) uploads for EC_WRITEBACK_DRAIN_TIMEOUT; the
    stack's EC_WRITE_MODE=write-back override must not have them killed midway."""
    svc = config()["services"]["ec-cache"]
    env = svc["environment"]
    needed = float(env.get("EC_SHUTDOWN_TIMEOUT", server_default("EC_SHUTDOWN_TIMEOUT")))
    needed += float(
        env.get("EC_WRITEBACK_DRAIN_TIMEOUT", server_default("EC_WRITEBACK_DRAIN_TIMEOUT"))
    )
    assert _seconds(svc["stop_grace_period"]) >= needed
