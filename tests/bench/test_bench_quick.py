"""Smoke test of the benchmark: ``python -m bench --quick`` runs end to end.

No timing assertions: only that every contender ran and produced numbers, and that the
JSON, the markdown and the plots were written.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

GET_CONTENDERS = {
    "nginx+urllib3",
    "raw socket recv_into",
    "ec-cache SDK, disk hit",
    "ec-cache urllib3, disk hit",
    "ec-cache SDK, S3 hit",
    "boto3 get_object",
    "safetensors load_file (node-local)",
}
PUT_CONTENDERS = {
    "nginx DAV PUT",
    "ec-cache SDK PUT, write-back",
    "ec-cache SDK PUT, write-back, idle queue",
    "ec-cache SDK PUT, disk only",
    "ec-cache SDK PUT, write-through",
    "boto3 put_object",
    "safetensors save_file (node-local)",
}
SCALE_CONTENDERS = {
    "nginx+urllib3",
    "ec-cache SDK, threads",
    "ec-cache AsyncClient, asyncio tasks",
    "ec-cache urllib3, threads",
}
PUT_SCALE_CONTENDERS = {
    "nginx DAV PUT",
    "ASGI floor PUT (receive only, urllib3)",
    "ec-cache SDK PUT, disk only",
    "ec-cache urllib3 PUT, disk only",
    "ec-cache SDK PUT, write-back",
    "ec-cache urllib3 PUT, write-back",
}
PLOTS = ["get_throughput.png", "put_throughput.png", "scale.png", "lookups.png", "eviction.png"]


def _number(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value >= 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        pytest.skip("nginx is not installed")
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


@pytest.mark.timeout(300)
def test_quick_run_writes_every_contender(quick_run: Path) -> None:
    results = json.loads((quick_run / "latest.json").read_text())
    assert results["meta"]["quick"] is True
    assert len(results["meta"]["loadavg_start"]) == 3
    # What produced it (bench/provenance.py): this checkout's commit, the machine.
    assert len(results["meta"]["commit"]) == 40 and results["meta"]["dirty"] in (True, False)
    assert results["meta"]["machine"]["cpus"] >= 1 and results["meta"]["machine"]["torch"]
    workloads = results["transfers"]["workloads"]
    assert "mixed" in workloads and len(workloads) >= 3
    for name, entry in workloads.items():
        assert set(entry["get"]) == GET_CONTENDERS, name
        for label, row in entry["get"].items():
            assert _number(row["mb_per_s_median"]) and row["mb_per_s_median"] > 0, label
            assert _number(row["p50_ms"]) and _number(row["p99_ms"]), label
        # every S3-hit GET really came from S3 (the cold server's disk always missed)
        assert (
            entry["cold_server_lookups"]["s3"] >= entry["get"]["ec-cache SDK, S3 hit"]["requests"]
        )
        if name != "mixed":
            assert set(entry["put"]) == PUT_CONTENDERS, name
            for label, row in entry["put"].items():
                assert _number(row["mb_per_s_median"]) and row["mb_per_s_median"] > 0, label
    rows = results["lookups"]["rows"]
    for key in (
        "ec-cache SDK head x1",
        "ec-cache SDK head x64",
        "ec-cache SDK head, interleaved",
        "exists_many 1 present",
        "exists_many 100 present",
        "exists_many 1000 present",
    ):
        assert _number(rows[key]["p50_ms"]), key
    for entry in results["scale"]["payloads"].values():
        levels = entry["levels"]
        assert set(levels) == {"1", "4", "16", "64"}
        for level in levels.values():
            assert set(level) == SCALE_CONTENDERS
            for row in level.values():
                assert _number(row["mb_per_s_median"]) and _number(row["p99_ms"])
    put_scale = results["put_scale"]
    assert set(put_scale["levels"]) == {"1", "4", "16"}
    for level in put_scale["levels"].values():
        assert set(level) == PUT_SCALE_CONTENDERS
        for row in level.values():
            assert _number(row["mb_per_s_median"]) and row["mb_per_s_median"] > 0
            assert _number(row["server_cpu_s_per_gb"])
    # the ec-cache servers report their group commits: every stored entry in a batch
    for label in PUT_SCALE_CONTENDERS - {"nginx DAV PUT", "ASGI floor PUT (receive only, urllib3)"}:
        runs = put_scale["levels"]["16"][label]["runs"]
        assert all(run["commit"]["ec_disk_commit_batch_size_sum"] >= 1 for run in runs), label
    memory = results["memory"]
    assert memory["clients"] == 64 and memory["peak_during"]["VmHWM"] > 0
    assert "RssAnon" in memory["peak_during"]
    assert all(_number(r["time_to_healthz_s"]) for r in results["startup"]["rows"].values())
    assert results["eviction"]["evictions"] > 0
    assert results["targets"], "targets were not evaluated"
    for row in results["targets"]:
        assert isinstance(row["pass"], bool) and _number(abs(row["ratio"]))


def test_quick_run_writes_markdown_and_plots(quick_run: Path) -> None:
    markdown = (quick_run / "latest.md").read_text()
    for label in GET_CONTENDERS | PUT_CONTENDERS:
        assert f"| {label} |" in markdown, label
    assert "## Targets" in markdown
    assert "PASS" in markdown or "MISS" in markdown
    for plot in PLOTS:
        data = (quick_run / plot).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000, plot
        assert f"]({plot})" in markdown or plot == "eviction.png"
