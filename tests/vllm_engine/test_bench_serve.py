"""Smoke of ``make bench-serve`` (bench/serve.py --smoke): vLLM's own benchmark client
against real vLLM servers with the connector, a handful of requests, three rows. No
timing assertions: every request completes, and the counters say where each row's
encoder outputs came from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testkit.vllm_engine import ROOT

PROMPTS = 4


def test_bench_serve_smoke(engine_python: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.serve", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = json.loads((tmp_path / "serve-smoke.json").read_text())
    rows = {row["row"]: row for row in results["rows"]}
    assert list(rows) == ["cold", "warm", "S3 replica"]
    for row in rows.values():
        assert (row["completed"], row["failed"]) == (PROMPTS, 0)
        assert row["ttft_p50_ms"] > 0 and row["output_tokens_per_s"] > 0
    # vLLM's own client sends one more request first (its "initial test run").
    cold = rows["cold"]
    assert cold["connector"].get("vllm:ec_cache_hits_total", 0) == 0
    assert cold["connector"]["vllm:ec_cache_misses_total"] >= PROMPTS
    assert cold["server"]["ec_put_bytes_total"] > 0
    # A fresh server on the second replica: every image a hit, read through from S3.
    replica = rows["S3 replica"]
    assert replica["connector"]["vllm:ec_cache_hits_total"] >= PROMPTS
    assert replica["connector"].get("vllm:ec_cache_misses_total", 0) == 0
    assert replica["server"]["ec_cache_lookups_total{result=s3}"] >= PROMPTS
    assert "| S3 replica |" in (tmp_path / "serve-smoke.md").read_text()
