"""Smoke of ``make bench-break-even`` (bench/break_even.py --smoke): the three encoders,
tiny, built and run by transformers in the engine venv, then the SDK's loads of entries
of their outputs' sizes from a real ec-cache and a real S3. No timing assertions: the
encoders produced what vLLM stores for each architecture, the loads were the hits they
claim to be, and every figure of the table is its JSON's (tests/bench/test_break_even.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.encoder_time import SMOKE
from testkit.vllm_engine import ROOT
from tests.bench.test_break_even import assert_table_matches


def test_bench_break_even_smoke(engine_python: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.break_even",
            "--smoke",
            "--reps",
            "2",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = json.loads((tmp_path / "break-even.json").read_text())
    encoders = results["encoders"]["encoders"]
    # 112x112 images: Qwen2.5-VL's 28-pixel tokens 4x4; Qwen3-VL's 32-pixel ones round
    # 3.5 up to 4x4, and its entry is the merger's output and two deepstack outputs.
    width = SMOKE["qwen25"]["out_hidden_size"]
    assert encoders["qwen25vl-2691x3584"]["output_shape"] == [16, width]
    assert encoders["qwen3vl-2040x16384"]["output_shape"] == [16, 3 * width]
    # CLIP at 56x56 in 14-pixel patches: 16 patches, the CLS token dropped.
    assert encoders["llava-576x4096"]["output_shape"] == [16, SMOKE["llava"]["text_hidden_size"]]
    assert all(len(enc["ms"]) == 2 for enc in encoders.values())
    loads = results["loads"]
    assert loads["link_rates"] == [] and loads["link_not_shaped"]  # a smoke run leaves tc alone
    for name, entry in loads["payloads"].items():
        assert entry["cold_server_lookups"]["disk"] == 0, name
        assert entry["cold_server_lookups"]["s3"] > 0, name
    assert_table_matches((tmp_path / "break-even.md").read_text(), results)
