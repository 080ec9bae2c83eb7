"""Smoke test of the benchmark's ``s3`` section (``python -m bench --quick --sections s3``).

No timing assertions: every contender ran and produced numbers, the S3-hit GETs were S3
hits, and the output says whether S3 was isolated from the client's and server's cores
and whether its link was shaped.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import s3_paths

ROOT = Path(__file__).resolve().parents[2]


def _number(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value >= 0


@pytest.mark.timeout(300)
def test_quick_s3_section(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--sections", "s3", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "s3: " in proc.stdout  # the isolation line
    results = json.loads((tmp_path / "latest.json").read_text())
    section = results["s3"]
    assert isinstance(section["pinned"], bool) and section["isolation"]
    # Shaped, or says why not (no tc, no CAP_NET_ADMIN, loopback already shaped).
    assert bool(section["link_rates"]) != bool(section["link_not_shaped"]), section
    for name, entry in section["payloads"].items():
        assert set(entry["get"]) == {
            s3_paths.BOTO3_GET,
            s3_paths.SDK_S3_GET,
            s3_paths.URLLIB3_S3_GET,
            s3_paths.SDK_DISK_GET,
        }, name
        assert set(entry["put"]) == {s3_paths.BOTO3_PUT, s3_paths.SDK_PUT}, name
        for row in [*entry["get"].values(), *entry["put"].values()]:
            assert _number(row["mb_per_s_median"]) and row["mb_per_s_median"] > 0
            assert _number(row["s3_cpu_s_per_gb"]) and _number(row["client_cpu_s_per_gb"])
        for label in (s3_paths.SDK_S3_GET, s3_paths.SDK_DISK_GET, s3_paths.SDK_PUT):
            assert _number(entry["get" if "GET" in label else "put"][label]["server_cpu_s_per_gb"])
        for label in (s3_paths.URLLIB3_S3_GET, s3_paths.BOTO3_GET):
            assert _number(entry["get"][label]["ttfb_p50_ms"])
        # Behind a shaped S3 link (where tc allows) and with the client alone on its
        # core (where pinning works): the same GETs, with numbers.
        assert set(entry["get_shaped"]) == set(section["link_rates"]), name
        for rows in entry["get_shaped"].values():
            assert set(rows) == {s3_paths.BOTO3_GET, s3_paths.SDK_S3_GET}, name
            assert all(row["mb_per_s_median"] > 0 for row in rows.values())
        if section["pinned"]:
            alone = entry["ttfb_client_alone"]
            assert all(_number(alone[label]["ttfb_p50_ms"]) for label in alone), name
        lookups = entry["cold_server_lookups"]
        assert lookups["disk"] == 0 and lookups["s3"] > 0, lookups
    names = {row["target"] for row in results["targets"]}
    assert any("write-through PUT" in n for n in names)
    assert "## S3 paths" in (tmp_path / "latest.md").read_text()
