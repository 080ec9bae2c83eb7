"""When loading an encoder output beats computing it, both measured on one machine.

    python -m bench.break_even [--reps 5] [--qwen-image 448x448] [--out bench/results]
    python -m bench.break_even --smoke --out DIR     # tiny encoders and entries, no tc (a test)
    python -m bench.break_even --render              # break-even.md again from its JSON

In one run (``make bench-break-even``, ~5 min on the 2-core build VM):

1. **computing**: the vision encoders of Qwen2.5-VL-7B, Qwen3-VL-8B and LLaVA-1.5-7B,
   built from their configs with random weights and timed on this CPU
   (``bench/encoder_time.py``, in the vLLM engine venv, which has transformers): ms per
   image and per MB of the output vLLM stores (bf16);
2. **loading**: the SDK's ``get`` of an entry of each model's 1080p size into a tensor,
   as a disk hit and as an S3 read-through, on loopback and behind S3's per-connection
   link where tc allows: the GETs of the full benchmark's ``s3`` section
   (``bench/s3_paths.py``), run on these three entries only.

Per MB, loading wins wherever the encoder takes longer than the load; the table gives
the ratio. Published GPU encoder times stand in a table of their own, marked as cited,
with their source and what the source measured. Writes ``break-even.json`` (every raw
number, the commit, date and machine) and ``break-even.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import provenance, s3_link, s3_paths, suite
from bench.lifecycle import unwind_on_sigterm
from bench.payloads import FULL_PAYLOADS, Payload
from bench.services import Services
from testkit.vllm_engine import ENGINE_PYTHON, ROOT, engine_module_json

MB = 1_000_000
DISK = s3_paths.SDK_DISK_GET
S3 = s3_paths.SDK_S3_GET
#: (requests per round, rounds) of the loads, per entry: as the full ``s3`` section.
LOAD_REQUESTS = {
    "llava-576x4096": (12, 5),
    "qwen25vl-2691x3584": (6, 5),
    "qwen3vl-2040x16384": (3, 5),
}
SMOKE_LOAD_REQUESTS = (2, 1)
#: Published encoder times: not measured here. Each with its source and what the source
#: measured; payload name -> fields.
CITED: dict[str, dict[str, Any]] = {
    "qwen25vl-2691x3584": {
        "model": "Qwen2.5-VL-7B",
        "image": "1080p",
        "encoder_ms": 167.0,
        "output_bytes": 2691 * 3584 * 2,
        "device": "H100, vLLM 0.19.1",
        "source": "vllm-project/vllm#41267",
        "caveat": "inferred in the issue, not measured: end-to-end 293 ms minus prefill "
        "126 ms, so preprocessing is likely included",
    },
    "llava-576x4096": {
        "model": "LLaVA-1.5-7B",
        "image": "336x336",
        "encoder_ms": 129.0,
        "output_bytes": 576 * 4096 * 2,
        "device": "Apple M2, llama.cpp",
        "source": "ggml-org/llama.cpp#6883",
        "caveat": "llama.cpp's CLIP on a laptop chip; no datacenter-GPU figure found",
    },
}


def time_encoders(reps: int, qwen_image: str, smoke: bool, work: Path) -> dict[str, Any]:
    """``bench/encoder_time.py`` in the engine venv."""
    if not ENGINE_PYTHON.exists():
        raise SystemExit(f"{ENGINE_PYTHON} is missing: scripts/setup-vllm-engine-venv.sh makes it")
    args = ["--reps", str(reps), "--qwen-image", qwen_image] + (["--smoke"] if smoke else [])
    return engine_module_json("bench.encoder_time", args, work / "tmp-encoders", timeout=1800)


def load_payloads(encoders: dict[str, Any], smoke: bool) -> dict[str, Payload]:
    """Encoder -> the entry to load: the model's 1080p entry (bench/payloads.py; smoke:
    the tiny encoder's output)."""
    if smoke:
        return {
            name: Payload(f"{name}-smoke", (enc["output_shape"][0], enc["output_shape"][1]))
            for name, enc in encoders.items()
        }
    full = {p.name: p for p in FULL_PAYLOADS}
    return {name: full[name] for name in encoders}


def p50_ms(row: dict[str, Any]) -> tuple[float, float, float]:
    """A load row's p50 over all requests, and the lowest and highest round's p50 (ms)."""
    rounds = [statistics.median(r) * 1e3 for r in row["raw_seconds"]]
    flat = [s for r in row["raw_seconds"] for s in r]
    return statistics.median(flat) * 1e3, min(rounds), max(rounds)


def table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model: its encoder's ms/MB here next to the loads' ms/MB here."""
    loads = results["loads"]
    link = loads["link_rates"][0] if loads["link_rates"] else None
    rows = []
    for name, enc in results["encoders"]["encoders"].items():
        entry = loads["payloads"][results["entries"][name]]
        entry_mb = entry["entry_bytes"] / MB
        out_mb = enc["output_bytes"] / MB
        disk = p50_ms(entry["get"][DISK])
        s3 = p50_ms(entry["get"][S3])
        shaped = p50_ms(entry["get_shaped"][link][S3]) if link else None
        encoder_ms_per_mb = enc["ms_median"] / out_mb
        rows.append(
            {
                "payload": name,
                "model": enc["model"],
                "part": enc["part"],
                "image": enc["image"],
                "output_mb": out_mb,
                "encoder_ms": [enc["ms_median"], enc["ms_min"], enc["ms_max"]],
                "encoder_ms_per_mb": [
                    enc["ms_median"] / out_mb,
                    enc["ms_min"] / out_mb,
                    enc["ms_max"] / out_mb,
                ],
                "entry_mb": entry_mb,
                "disk_hit_ms_per_mb": [x / entry_mb for x in disk],
                "s3_read_through_ms_per_mb": [x / entry_mb for x in s3],
                "s3_link": link,
                "s3_link_read_through_ms_per_mb": [x / entry_mb for x in shaped]
                if shaped
                else None,
                "encoder_over_disk": encoder_ms_per_mb / (disk[0] / entry_mb),
                "encoder_over_s3_link": encoder_ms_per_mb / (shaped[0] / entry_mb)
                if shaped
                else None,
            }
        )
    return rows


def cited_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The published figures, per MB, against the loads measured in this run."""
    out = []
    for row in rows:
        cited = CITED.get(row["payload"])
        if cited is None:
            continue
        per_mb = cited["encoder_ms"] / (cited["output_bytes"] / MB)
        link = row["s3_link_read_through_ms_per_mb"]
        out.append(
            {
                **cited,
                "payload": row["payload"],
                "encoder_ms_per_mb": per_mb,
                "over_disk": per_mb / row["disk_hit_ms_per_mb"][0],
                "over_s3_link": per_mb / link[0] if link else None,
            }
        )
    return out


def fig(value: float) -> str:
    """Three significant digits or so: 1234, 123, 12.3, 1.23, 0.62."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def spread(values: list[float]) -> str:
    return f"{fig(values[0])} ({fig(values[1])}-{fig(values[2])})"


def markdown(results: dict[str, Any]) -> str:
    meta, enc, loads = results["meta"], results["encoders"], results["loads"]
    rows, cited = results["rows"], results["cited"]
    link = loads["link_rates"][0] if loads["link_rates"] else None
    link_text = (
        f"behind S3's link ({link}, ~90 MB/s per connection, `bench/s3_link.py`)"
        if link
        else f"(S3 link NOT shaped: {loads['link_not_shaped']})"
    )
    dirty = " with uncommitted changes" if meta["dirty"] else ""
    lines = [
        "# Break-even: computing an encoder output or loading it",
        "",
        f"One run of `{meta['command']}`, {meta['started']}, commit "
        f"{(meta['commit'] or '?')[:12]}{dirty}; {meta['machine']['cpu']}, "
        f"{meta['machine']['cpus']} CPUs, "
        f"load average {meta['loadavg_start'][0]} -> {meta['loadavg_end'][0]}. "
        "Raw numbers: `break-even.json`.",
        "",
        "## Measured here, in this run",
        "",
        f"Encoders (`bench/encoder_time.py`): random weights in each model's real shapes, "
        f"{enc['dtype']}, torch threads: {enc['torch_threads']}, transformers "
        f"{enc['transformers']}; ms per image: median of {enc['reps']} passes after "
        f"{enc['warm_up_passes']} warm-up (min-max). Loads (`bench/s3_paths.py`): the SDK's "
        "`get` of an entry of the model's 1080p size into a tensor, p50 of all requests "
        f"(min-max of the rounds' p50s); S3 read-through on loopback / {link_text}. "
        "Loading wins where the encoder needs more ms per MB than the load; the last column "
        "says how many times more.",
        "",
        "| model: what runs | image -> output | encoder ms per image | encoder ms/MB | entry "
        "| disk hit ms/MB | S3 read-through ms/MB: loopback / link | encoder / load: disk / S3 link |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s3_link_cell = spread(row["s3_link_read_through_ms_per_mb"]) if link else "-"
        over_link = f"{fig(row['encoder_over_s3_link'])}x" if link else "-"
        lines.append(
            f"| {row['model']}: {row['part']} | {row['image']} -> {row['output_mb']:.2f} MB "
            f"| {spread(row['encoder_ms'])} | {spread(row['encoder_ms_per_mb'])} "
            f"| {row['entry_mb']:.1f} MB | {spread(row['disk_hit_ms_per_mb'])} "
            f"| {spread(row['s3_read_through_ms_per_mb'])} / {s3_link_cell} "
            f"| {fig(row['encoder_over_disk'])}x / {over_link} |"
        )
    lines += [
        "",
        "## Cited, not measured here",
        "",
        "Published encoder times, per MB of the entry they produce, against the loads "
        "measured above (a GPU figure against loads on this CPU: the ratio mixes machines).",
        "",
        "| model, image | encoder ms (*cited*) | ms/MB | where | source | what it is "
        "| cited / load: disk / S3 link |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in cited:
        over_link = f"{fig(row['over_s3_link'])}x" if row["over_s3_link"] else "-"
        lines.append(
            f"| {row['model']}, {row['image']} | *{fig(row['encoder_ms'])}* "
            f"| *{fig(row['encoder_ms_per_mb'])}* | {row['device']} | {row['source']} "
            f"| {row['caveat']} | {fig(row['over_disk'])}x / {over_link} |"
        )
    lines += [
        "",
        f"Caveats: the Qwen towers ran on a {rows[0]['image']} image, the entries loaded are "
        "a 1080p image's; attention grows with the square of the patches (Qwen3-VL attends "
        "globally in every layer), so the larger the image, the more ms per MB it costs. "
        "The CPU is not the GPU a deployment encodes on: the measured ratios say where this "
        "machine breaks even, the cited rows where a GPU would. S3 on loopback has no round "
        "trip (`bench/s3_link.py`).",
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, work: Path, log: Any) -> dict[str, Any]:
    started = time.monotonic()
    meta: dict[str, Any] = {
        "command": "python -m bench.break_even" + "".join(f" {a}" for a in args.argv),
        **provenance.started(suite.machine()),
    }
    log("encoders: building and timing (engine venv)")
    encoders = time_encoders(args.reps, args.qwen_image, args.smoke, work)
    for name, enc in encoders["encoders"].items():
        log(f"encoders: {name} {enc['ms_median']:.0f} ms, {enc['ms_per_mb_median']:.0f} ms/MB")
    entries = load_payloads(encoders["encoders"], args.smoke)
    requests = {
        p.name: SMOKE_LOAD_REQUESTS if args.smoke else LOAD_REQUESTS[p.name]
        for p in entries.values()
    }
    services = Services(work / "loads")
    try:
        # The smoke run leaves loopback unshaped: tc's qdisc is the whole machine's.
        rates = [] if args.smoke else [s3_link.PER_CONNECTION]
        loads = s3_paths.measure(
            services, list(entries.values()), requests, rates, log, gets_only=True
        )
    finally:
        services.close()
    provenance.finished(meta, started)
    results: dict[str, Any] = {
        "meta": meta,
        "encoders": encoders,
        "entries": {name: p.name for name, p in entries.items()},
        "loads": loads,
    }
    results["rows"] = table(results)
    results["cited"] = cited_rows(results["rows"])
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5, help="timed passes per encoder")
    parser.add_argument("--qwen-image", default="448x448", help="WxH for the Qwen towers")
    parser.add_argument("--smoke", action="store_true", help="tiny encoders and entries")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument(
        "--render", action="store_true", help="rewrite break-even.md from --out's JSON only"
    )
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads((args.out / "break-even.json").read_text())
        (args.out / "break-even.md").write_text(markdown(results))
        return
    args.argv = sys.argv[1:] if argv is None else argv
    # Large copies through torch's intra-op pool stall when the other core is busy; the
    # loads compute nothing (as in ``python -m bench``).
    torch.set_num_threads(1)
    unwind_on_sigterm()
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="ec-break-even-"))
    try:
        results = run(args, work, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "break-even.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "break-even.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
