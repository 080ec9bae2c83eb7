"""Smoke test of ``python -m bench.s3_readthrough`` (one round of one request): the
link check and every contender produced numbers, or the run says why the link cannot
be shaped here. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import s3_link, s3_readthrough

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_one_round_makes_the_whole_table(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.s3_readthrough",
            *("--rounds", "1", "--count", "1", "--out", str(tmp_path)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    why_not = s3_link.why_not()
    if why_not:
        assert proc.returncode != 0 and why_not in proc.stderr, proc.stderr[-2000:]
        return
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "s3-readthrough.json").read_text())
    check = results["link_check"]
    assert check["one_stream_mb_per_s"] > 0 and check["streams_scaling"] > 0
    assert set(results["payloads"]) == {p.name for p in s3_readthrough.PAYLOADS}
    for rows in results["payloads"].values():
        for label in (s3_readthrough.RANGED, s3_readthrough.SINGLE, s3_readthrough.SDK):
            assert rows[label]["mb_per_s_median"] > 0 and rows[label]["server_cpu_s_per_gb"] > 0
        assert rows[s3_readthrough.TRANSFER]["mb_per_s_median"] > 0
    assert "x TransferManager" in (tmp_path / "s3-readthrough.md").read_text()
