"""The break-even table (``bench/break_even.py``) against the JSON it was written from.

Every figure in ``break-even.md`` is recomputed here from the raw numbers of
``break-even.json`` (each encoder pass, each load's seconds), with this file's own
arithmetic, and compared with what the table shows, to the digits it shows; README.md's
break-even sentence is checked against the same JSON. The smoke run of the whole bench
(tiny encoders, in the engine venv) is tests/vllm_engine/test_bench_break_even.py, which
checks its own table with :func:`assert_table_matches`.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from bench.encoder_time import CLIP_VIT_L_336, QWEN3_VL_8B, QWEN25_VL_7B, qwen_grid
from bench.payloads import FULL_PAYLOADS

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
MB = 1e6
DISK = "ec-cache SDK GET, disk hit"
S3 = "ec-cache SDK GET, S3 hit (read-through)"
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def table_rows(markdown: str, header_start: str) -> list[list[str]]:
    """The cells of each body row of the table whose header begins ``header_start``."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def assert_shows(cell: str, values: list[float]) -> None:
    """``cell``'s numbers are ``values``, each to the digits it is shown with."""
    shown = NUMBER.findall(cell)
    assert len(shown) == len(values), (cell, values)
    for text, value in zip(shown, values, strict=True):
        decimals = len(text.partition(".")[2])
        assert abs(float(text) - value) <= 0.5 * 10**-decimals + 1e-6 * value, (cell, values)


def p50_ms(row: dict[str, Any]) -> list[float]:
    """p50 of every request, then of the fastest and the slowest round, in ms."""
    rounds = [statistics.median(r) * 1e3 for r in row["raw_seconds"]]
    everything = statistics.median([s for r in row["raw_seconds"] for s in r]) * 1e3
    return [everything, min(rounds), max(rounds)]


def assert_table_matches(markdown: str, results: dict[str, Any]) -> None:
    """Every figure of both tables, recomputed from the raw numbers."""
    measured = table_rows(markdown, "| model: what runs")
    encoders = results["encoders"]["encoders"]
    loads = results["loads"]
    link = loads["link_rates"][0] if loads["link_rates"] else None
    assert len(measured) == len(encoders) == 3
    per_mb_disk = {}
    per_mb_link = {}
    for cells, (name, enc) in zip(measured, encoders.items(), strict=True):
        entry = loads["payloads"][results["entries"][name]]
        out_mb = enc["output_bytes"] / MB
        entry_mb = entry["entry_bytes"] / MB
        assert enc["output_bytes"] == enc["output_shape"][0] * enc["output_shape"][1] * 2
        ms = [statistics.median(enc["ms"]), min(enc["ms"]), max(enc["ms"])]
        assert len(enc["ms"]) == results["encoders"]["reps"]
        disk = [x / entry_mb for x in p50_ms(entry["get"][DISK])]
        s3 = [x / entry_mb for x in p50_ms(entry["get"][S3])]
        assert cells[0].startswith(enc["model"])
        assert_shows(cells[1].partition("->")[2], [out_mb])
        assert_shows(cells[2], ms)
        assert_shows(cells[3], [x / out_mb for x in ms])
        assert_shows(cells[4], [entry_mb])
        assert_shows(cells[5], disk)
        loopback, _, behind_link = cells[6].partition(" / ")
        assert_shows(loopback, s3)
        disk_ratio, _, link_ratio = cells[7].partition(" / ")
        assert_shows(disk_ratio, [ms[0] / out_mb / disk[0]])
        per_mb_disk[name] = disk[0]
        if link is None:
            assert behind_link == "-" and link_ratio == "-"
            continue
        shaped = [x / entry_mb for x in p50_ms(entry["get_shaped"][link][S3])]
        assert_shows(behind_link, shaped)
        assert_shows(link_ratio, [ms[0] / out_mb / shaped[0]])
        per_mb_link[name] = shaped[0]

    cited = table_rows(markdown, "| model, image | encoder ms (*cited*)")
    assert len(cited) == len(results["cited"]) >= 1
    for cells, row in zip(cited, results["cited"], strict=True):
        per_mb = row["encoder_ms"] / (row["output_bytes"] / MB)
        assert cells[1] == f"*{row['encoder_ms']:.0f}*"
        assert_shows(cells[2], [per_mb])
        assert cells[4] == row["source"] and cells[5] == row["caveat"]
        disk_ratio, _, link_ratio = cells[6].partition(" / ")
        assert_shows(disk_ratio, [per_mb / per_mb_disk[row["payload"]]])
        if link is not None:
            assert_shows(link_ratio, [per_mb / per_mb_link[row["payload"]]])


def committed() -> tuple[str, dict[str, Any]]:
    results = json.loads((RESULTS / "break-even.json").read_text())
    return (RESULTS / "break-even.md").read_text(), results


def test_committed_table_is_its_json() -> None:
    markdown, results = committed()
    assert_table_matches(markdown, results)
    meta = results["meta"]
    assert re.fullmatch(r"[0-9a-f]{40}", meta["commit"]) and meta["started"]
    assert meta["dirty"] in (True, False)
    assert {"node", "cpus", "cpu", "memory_gib", "python"} <= set(meta["machine"])
    assert f"commit {meta['commit'][:12]}" in markdown


def test_committed_run_measured_the_real_shapes() -> None:
    """The full run timed the real towers: their outputs have the LLM's hidden size
    (Qwen3-VL: four of them side by side), and it loaded each model's 1080p entry."""
    _, results = committed()
    assert not results["encoders"]["smoke"]
    encoders = results["encoders"]["encoders"]
    widths = {name: enc["output_shape"][1] for name, enc in encoders.items()}
    assert widths == {
        "qwen25vl-2691x3584": QWEN25_VL_7B["out_hidden_size"],
        "qwen3vl-2040x16384": 4 * QWEN3_VL_8B["out_hidden_size"],
        "llava-576x4096": 4096,
    }
    assert encoders["llava-576x4096"]["output_shape"] == [576, 4096]
    assert encoders["llava-576x4096"]["image"] == f"{CLIP_VIT_L_336['image_size']}x336"
    full = {p.name: p.size for p in FULL_PAYLOADS}
    for name, entry in results["loads"]["payloads"].items():
        assert entry["entry_bytes"] == full[name]


def test_qwen_images_round_as_the_entries_assume() -> None:
    """A 1080p image gives the token counts of bench/payloads.py's entries."""
    for config, tokens in ((QWEN25_VL_7B, 2691), (QWEN3_VL_8B, 2040)):
        rows, cols = qwen_grid((1920, 1080), config)
        assert rows * cols // config["spatial_merge_size"] ** 2 == tokens


def test_readme_cites_the_committed_run() -> None:
    """README.md's break-even sentences: each figure as the committed JSON has it, the GPU
    figure marked as cited, with its source."""
    _, results = committed()
    readme = " ".join((ROOT / "README.md").read_text().split())
    qwen = next(row for row in results["rows"] if row["payload"] == "qwen25vl-2691x3584")
    cited = next(row for row in results["cited"] if row["payload"] == "qwen25vl-2691x3584")
    start = readme.index("In one run on the build VM")
    measured = readme[start : readme.index("*cited*", start)]
    figures = {
        "Qwen2.5-VL-7B's encoder took": qwen["encoder_ms_per_mb"][0],
        "a disk hit": qwen["disk_hit_ms_per_mb"][0],
        "S3 behind its link": qwen["s3_link_read_through_ms_per_mb"][0],
    }
    for phrase, value in figures.items():
        shown = re.search(re.escape(phrase) + r" (" + NUMBER.pattern + ") ms/MB", measured)
        assert shown, f"README.md: no figure after {phrase!r} in {measured!r}"
        assert_shows(shown.group(1), [value])
    assert f"a {qwen['image']} image" in measured
    gpu = re.search(r"\*cited\*: (\d+) ms for a 1080p image on an H100 \(([\d.]+) ms/MB\)", readme)
    assert gpu, "README.md: the cited GPU figure lost its mark or its form"
    assert_shows(gpu.group(1), [cited["encoder_ms"]])
    assert_shows(gpu.group(2), [cited["encoder_ms_per_mb"]])
    assert cited["source"] in readme[gpu.start() : gpu.end() + 300]
