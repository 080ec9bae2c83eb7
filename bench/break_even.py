"""When loading an encoder output beats computing it: the break-even table.

The load times are the full benchmark's own (``python -m bench``, section ``s3``,
``bench/results/latest.json``): the SDK's ``get`` of an entry into a tensor, as a disk
hit and as an S3 read-through (S3 on loopback, and behind S3's link: each connection at
~90 MB/s, as AWS serves one; runs before that link existed: a 1 Gbit/s link for all
connections), p50 over that section's requests, for the entry sizes of three real
models.
Next to them, the encoder times published for those models; the last columns say how
fast an encoder must be per MB of output for loading to lose (load ms / entry MB).

    python -m bench.break_even [--results bench/results/latest.json] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench import s3_link

ROOT = Path(__file__).resolve().parents[1]

#: Payload name -> (model, image, published encoder time in ms or None, source).
PUBLISHED: dict[str, tuple[str, str, float | None, str]] = {
    "llava-576x4096": (
        "LLaVA-1.5-7B (CLIP ViT-L/14-336)",
        "336x336",
        None,
        "no datacenter-GPU figure found; llama.cpp reports 129 ms on an Apple M2 "
        "(ggml-org/llama.cpp#6883)",
    ),
    "qwen25vl-2691x3584": (
        "Qwen2.5-VL-7B",
        "1080p",
        167.0,
        "H100, vLLM 0.19 (vllm-project/vllm#41267)",
    ),
    "qwen3vl-2040x16384": (
        "Qwen3-VL-8B",
        "1080p",
        None,
        "no published figure found",
    ),
}
DISK = "ec-cache SDK GET, disk hit"
S3 = "ec-cache SDK GET, S3 hit (read-through)"
#: The shaped links a run's ``get_shaped`` may hold, preferred first: S3's
#: per-connection link (``bench/s3_link.py``), else the 1 Gbit/s link of older runs.
LINKS = {s3_link.PER_CONNECTION: "S3 link (90 MB/s per connection)", "1gbit": "1 Gbit/s"}


def link_of(results: dict[str, Any]) -> str | None:
    """The shaped link the table reads (None: the run shaped none)."""
    shaped = [set(p.get("get_shaped", {})) for p in results["s3"]["payloads"].values()]
    return next((link for link in LINKS if shaped and all(link in s for s in shaped)), None)


def table(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    link = link_of(results)
    for name, payload in results["s3"]["payloads"].items():
        model, image, encoder_ms, source = PUBLISHED[name]
        mb = payload["entry_bytes"] / 1e6
        disk_ms = payload["get"][DISK]["p50_ms"]
        s3_ms = payload["get"][S3]["p50_ms"]
        shaped = payload.get("get_shaped", {}).get(link, {}).get(S3) if link else None
        s3_link_ms = shaped["p50_ms"] if shaped else None
        rows.append(
            {
                "payload": name,
                "model": model,
                "image": image,
                "entry_mb": round(mb, 1),
                "disk_hit_ms": disk_ms,
                "s3_read_through_ms": s3_ms,
                "link": LINKS[link] if link else None,
                "s3_read_through_link_ms": s3_link_ms,
                "published_encoder_ms": encoder_ms,
                "published_source": source,
                "break_even_disk_ms_per_mb": disk_ms / mb,
                "break_even_s3_link_ms_per_mb": s3_link_ms / mb if s3_link_ms else None,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], run: str) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    link = next((row["link"] for row in rows if row["link"]), "no shaped link")

    lines = [
        f"Load times: SDK `get` into a tensor, p50, from the full run of {run} "
        "(`python -m bench`, section s3). Loading loses when the encoder needs less "
        "than the last two columns per MB of its output.",
        "",
        f"| entry | model, image | disk hit ms | S3 read-through ms (loopback / {link}) "
        f"| published encoder ms, per MB of output | break-even ms/MB: disk / S3, {link} |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        published = (
            f"{row['published_encoder_ms']:.0f}, "
            f"{row['published_encoder_ms'] / row['entry_mb']:.1f} ms/MB ({row['published_source']})"
            if row["published_encoder_ms"] is not None
            else f"- ({row['published_source']})"
        )
        lines.append(
            f"| {row['entry_mb']} MB | {row['model']}, {row['image']} "
            f"| {ms(row['disk_hit_ms'])} "
            f"| {ms(row['s3_read_through_ms'])} / {ms(row['s3_read_through_link_ms'])} "
            f"| {published} | {row['break_even_disk_ms_per_mb']:.2f} / "
            f"{ms(row['break_even_s3_link_ms_per_mb'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The break-even table (bench/README.md).")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "latest.json")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    rows = table(results)
    run = results.get("meta", {}).get("started", args.results.name)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "break-even.json").write_text(json.dumps({"run": run, "rows": rows}, indent=1))
    (args.out / "break-even.md").write_text(markdown(rows, run))
    print(markdown(rows, run))


if __name__ == "__main__":
    main()
