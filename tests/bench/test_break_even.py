"""The break-even table is computed from a full benchmark run's S3 section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_break_even_table_from_the_latest_full_run(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.break_even", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "break-even.json").read_text())["rows"]
    assert [row["entry_mb"] for row in rows] == [4.7, 19.3, 66.8]
    for row in rows:
        assert 0 < row["disk_hit_ms"] < row["s3_read_through_ms"]
        assert abs(row["break_even_disk_ms_per_mb"] * row["entry_mb"] - row["disk_hit_ms"]) < 0.1
    assert "| 19.3 MB | Qwen2.5-VL-7B, 1080p |" in (tmp_path / "break-even.md").read_text()
