"""The GPU benchmark's logic, in its CPU mode: ``python -m bench.gpu --cpu --quick``.

The script itself is meant for a CUDA machine (see bench/README.md, "GPU path"); here
it runs end to end on the CPU against a real server, and this checks that every GET
method produced numbers, that every correctness check that applies on the CPU passed
(bytes equal, results never alias the staging pool), that the save path ran through
``Client.put`` and the vLLM connector's ``save_caches`` (with bench/vllm_shim.py), and
that the JSON and the markdown were written. No timing is asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

METHODS = {
    "a_recv_pinned",
    "b_recv_pinned_h2d",
    "c_get_device",
    "c2_get_device_out",
    "d_async8_device",
}
VARIANTS = {"put_thread", "put_thread_side_stream", "connector_save_caches"}


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("gpu-bench")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--cpu", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout


@pytest.mark.timeout(240)
def test_cpu_mode_measures_every_get_method(cpu_run: tuple[Path, str]) -> None:
    results = json.loads((cpu_run[0] / "gpu.json").read_text())
    assert "error" not in results, results.get("error")
    assert results["meta"]["device"] == "cpu" and results["meta"]["quick"] is True
    sizes = {k: v for k, v in results["get"].items() if isinstance(v, dict)}
    assert len(sizes) == 3
    for name, entry in sizes.items():
        assert set(entry["methods"]) == METHODS, name
        for method, row in entry["methods"].items():
            assert row["requests"] > 0, (name, method)
            assert _positive(row["mb_per_s_median"]), (name, method)
            assert _positive(row["p50_ms"]) and _positive(row["p99_ms"]), (name, method)
            assert row["mb_per_s_rounds"] and all(map(_positive, row["mb_per_s_rounds"]))
        assert entry["ratio_to_a"]["a_recv_pinned"] == 1.0


def test_cpu_mode_checks_pass_where_they_apply(cpu_run: tuple[Path, str]) -> None:
    checks = {c["name"]: c for c in json.loads((cpu_run[0] / "gpu.json").read_text())["checks"]}
    assert len(checks) == 5
    applied = [c for c in checks.values() if c["pass"] is not None]
    assert len(applied) == 2 and all(c["pass"] is True for c in applied), applied
    names = " ".join(checks)
    assert "equal the stored ones" in names and "never alias" in names
    # the stream and current-device checks need CUDA; they are reported, not skipped silently
    assert all(c["detail"] == "no CUDA" for c in checks.values() if c["pass"] is None)


def test_cpu_mode_runs_the_save_paths(cpu_run: tuple[Path, str]) -> None:
    save = json.loads((cpu_run[0] / "gpu.json").read_text())["save"]
    assert save["vllm"] in ("bench/vllm_shim.py stand-ins", "vLLM")
    assert set(save["variants"]) == VARIANTS
    assert len(save["alone_products_per_s"]) == len(VARIANTS) + 1
    for name, row in save["variants"].items():
        assert _positive(row["products_per_s"]) and _positive(row["speed_vs_alone"]), name
    for name in ("put_thread", "put_thread_side_stream"):
        row = save["variants"][name]
        assert row["errors"] == [] and row["saves_total"] >= 1, row
    connector = save["variants"]["connector_save_caches"]
    assert connector["flushed"] is True
    counters = connector["counters"]
    assert counters.get("save_enqueued", 0) >= 1 and counters.get("save_failed", 0) == 0
    assert counters.get("save_created", 0) >= 1, counters


def test_cpu_mode_writes_markdown(cpu_run: tuple[Path, str]) -> None:
    out, stdout = cpu_run
    markdown = (out / "gpu.md").read_text()
    assert "CPU mode (not GPU figures)" in markdown
    for heading in ("## GET", "## Save path", "## Checks", "## Targets"):
        assert heading in markdown, heading
    assert "FAIL" not in markdown and "not judged (CPU)" in markdown
    assert markdown.strip() in stdout
