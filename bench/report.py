"""Markdown tables and PNG plots from a results JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import provenance, put_scale, s3_paths
from bench.readme_blocks import Block, wrapped

PLOTS = {
    "get": "get_throughput.png",
    "put": "put_throughput.png",
    "scale": "scale.png",
    "lookups": "lookups.png",
    "eviction": "eviction.png",
}
GET_REFERENCE = "nginx+urllib3"
PUT_REFERENCE = "nginx DAV PUT"


def _mb(n: float) -> str:
    return f"{n / 1e6:.3g} MB" if n >= 1e6 else f"{n / 1024:.0f} KiB"


def _f(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    out: list[str] = [
        f"# ec-cache benchmark ({'quick smoke run' if meta['quick'] else 'full run'})",
        "",
        f"{meta['started']}, {meta['duration_s']:.0f} s on {meta['machine']['node']} "
        f"({meta['machine']['cpus']} CPUs, Python {meta['machine']['python']}, "
        f"torch {meta['machine']['torch']}, {meta['machine']['torch_threads']} torch thread). "
        f"Load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']} "
        "(a shared box: compare ratios within this run, not absolute numbers across runs).",
        "Everything on 127.0.0.1; client and servers share the same cores. MB = 1e6 bytes. "
        "Throughput is the median over interleaved rounds of (bytes / time) of sequential "
        "requests on one keep-alive connection; p50/p99 over all requests.",
        "",
    ]
    if meta["quick"]:
        out += ["**Quick mode: tiny payloads and few rounds; the numbers mean nothing.**", ""]
    rows = results.get("targets", [])
    if rows:
        out += ["## Targets", "", "| target | want | measured | result |", "|---|---|---|---|"]
        for row in rows:
            verdict = f"PASS (+{row['by']:.2f})" if row["pass"] else f"**MISS** by {-row['by']:.2f}"
            out.append(f"| {row['target']} | {row['want']} | {row['ratio']:.2f}x | {verdict} |")
        out.append("")
    transfers = results.get("transfers")
    if transfers:
        out += ["## GET", "", f"![GET throughput]({PLOTS['get']})", ""]
        for name, entry in transfers["workloads"].items():
            sizes = entry["entry_bytes"]
            what = (
                f"{entry.get('shape', '')} bf16, {_mb(sizes['max'])}"
                if "shape" in entry
                else f"{sizes['keys']} entries {_mb(sizes['min'])}-{_mb(sizes['max'])}"
            )
            out += [
                f"### {name}: {what}",
                "",
                f"{entry['note']}. Load {entry['loadavg_before']} -> {entry['loadavg_after']}. "
                f"S3-hit server lookups: {entry['cold_server_lookups']}.",
                "",
            ]
            out += _transfer_table(entry["get"], GET_REFERENCE)
            if "put" in entry:
                out += ["", f"PUT, {name}:", ""]
                out += _transfer_table(entry["put"], PUT_REFERENCE)
            out.append("")
        out += ["## PUT", "", f"![PUT throughput]({PLOTS['put']})", ""]
        for name, entry in transfers["workloads"].items():
            if "put" in entry:
                drains = [
                    d["upload_queue_drain_s"]
                    for d in entry["put"]["ec-cache SDK PUT, write-back"].get("after_round", [])
                ]
                if drains:
                    out.append(
                        f"* {name}: write-back upload queue drained {min(drains):.2f}-"
                        f"{max(drains):.2f} s after each round (untimed)"
                    )
        out.append("")
    out += put_scale.markdown(results)
    lookups = results.get("lookups")
    if lookups:
        out += [
            "## The scheduler's question: HEAD and batch existence",
            "",
            f"![lookups]({PLOTS['lookups']})",
            "",
            f"Server: {lookups['server']}.",
            "",
            "| what | clients | requests | p50 ms | p99 ms | per s |",
            "|---|---|---|---|---|---|",
        ]
        for row in lookups["rows"].values():
            out.append(
                f"| {row['what']} | {row['clients']} | {row['requests']} | {_f(row['p50_ms'])} "
                f"| {_f(row['p99_ms'])} | {row['per_s']:.0f} |"
            )
        out.append("")
    floor = results.get("floor")
    if floor:
        out += [
            f"## Small requests against the framework floor ({_mb(floor['entry_bytes'])})",
            "",
            "One keep-alive connection each; the floor is a raw ASGI app on ec-cache's "
            "uvicorn options (`bench/asgi_floor.py`).",
            "",
            "| contender | kind | p50 ms | p99 ms | MB/s |",
            "|---|---|---|---|---|",
        ]
        for label, row in floor["contenders"].items():
            out.append(
                f"| {label} | {row['kind']} | {_f(row['p50_ms'], 3)} | {_f(row['p99_ms'], 3)} "
                f"| {row.get('mb_per_s_median', 0):.0f} |"
            )
        out.append("")
    scale = results.get("scale")
    if scale:
        out += [
            "## Scale: concurrent clients, disk-hit GET",
            "",
            f"![scale]({PLOTS['scale']})",
            "",
            f"Clients are {scale['clients_are']}. `x urllib3` is the contender's MB/s over "
            "urllib3's against the same ec-cache server in the same run.",
            "",
        ]
        for name, entry in scale["payloads"].items():
            out += [
                f"### {name} ({_mb(entry['entry_bytes'])})",
                "",
                "| clients | contender | MB/s (aggregate) | x urllib3 | p50 ms | p99 ms |",
                "|---|---|---|---|---|---|",
            ]
            for clients, level in entry["levels"].items():
                reference = level.get("ec-cache urllib3, threads", {}).get("mb_per_s_median")
                for label, row in level.items():
                    ratio = row["mb_per_s_median"] / reference if reference else float("nan")
                    out.append(
                        f"| {clients} | {label} | {row['mb_per_s_median']:.0f} | {ratio:.2f} | "
                        f"{_f(row['p50_ms'])} | {_f(row['p99_ms'])} |"
                    )
            out.append("")
    mem = results.get("memory")
    if mem:
        peak = mem["peak_during"]
        out += [
            "## Server memory under 64 concurrent large GETs",
            "",
            f"{mem['clients']} clients x {mem['gets_per_client']} GETs of "
            f"{_mb(mem['entry_bytes'])} ({mem['distinct_entries']} distinct entries), fresh "
            f"server, {mem['client']}. Naive buffering would need "
            f"{mem['naive_bytes'] / 2**20:.0f} MiB. mmap'd file pages count in RSS "
            "(RssFile); RssAnon is the server's own memory.",
            "",
            "| | VmRSS MiB | RssAnon MiB | RssFile MiB | VmHWM MiB |",
            "|---|---|---|---|---|",
        ]
        for label, values in (
            ("at start", mem["at_start"]),
            ("after one GET per entry", mem["after_warmup"]),
            (f"peak during ({mem['samples']} samples)", peak),
            ("after", mem["after"]),
        ):
            out.append(
                "| "
                + label
                + " | "
                + " | ".join(
                    f"{values.get(k, 0) / 2**20:.0f}"
                    for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")
                )
                + " |"
            )
        out += [
            "",
            f"Aggregate {mem['mb_per_s']:.0f} MB/s, p99 {mem['p99_ms']:.0f} ms per GET.",
            "",
        ]
    start = results.get("startup")
    if start:
        out += [
            "## Start-up: index rebuild",
            "",
            f"{start['how']}; entries of {start['entry_bytes']} bytes.",
            "",
            "| entries | process start to /healthz s | PUT p50 ms (evicts one) | PUT p99 ms |",
            "|---|---|---|---|",
        ]
        for row in start["rows"].values():
            out.append(
                f"| {row['entries']} | {_f(row['time_to_healthz_s'])} | "
                f"{_f(row['put_evicting_p50_ms'])} | {_f(row['put_evicting_p99_ms'])} |"
            )
        out.append("")
    ev = results.get("eviction")
    if ev:
        out += [
            "## Eviction as the disk tier fills",
            "",
            f"![eviction]({PLOTS['eviction']})",
            "",
            f"Disk-only server bounded to {ev['capacity_entries']} entries of "
            f"{_mb(ev['entry_bytes'])}; {ev['puts']} sequential SDK PUTs "
            f"({ev['evictions']} evictions). PUT p50 while filling "
            f"{_f(ev['filling_p50_ms'])} ms; once every PUT evicts one: p50 "
            f"{_f(ev['evicting_p50_ms'])} ms, p99 {_f(ev['evicting_p99_ms'])} ms.",
            "",
        ]
    return "\n".join(out) + "\n"


def _transfer_table(rows: dict[str, Any], reference: str) -> list[str]:
    ref = rows[reference]["mb_per_s_median"]
    lines = [
        f"| contender | kind | MB/s | vs {reference} | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for label, row in rows.items():
        mbs = row["mb_per_s_median"]
        lines.append(
            f"| {label} | {row['kind']} | {mbs:.0f} | {mbs / ref:.2f}x | {_f(row['p50_ms'])} "
            f"| {_f(row['p99_ms'])} |"
        )
    return lines


def _bars(ax: Any, groups: dict[str, dict[str, float]], ylabel: str) -> None:
    labels = sorted({label for values in groups.values() for label in values}, key=str)
    order = [label for values in groups.values() for label in values]
    labels = sorted(labels, key=order.index)
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, [values.get(label, 0) for values in groups.values()], width, label=label)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels(list(groups), fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)


def plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    written: list[Path] = []

    def save(fig: Any, key: str) -> None:
        path = out_dir / PLOTS[key]
        fig.tight_layout()
        fig.savefig(path, dpi=72)
        plt.close(fig)
        written.append(path)

    transfers = results.get("transfers")
    if transfers:
        workloads = transfers["workloads"]
        for key, part in (("get", "get"), ("put", "put")):
            groups = {
                name: {label: row["mb_per_s_median"] for label, row in entry[part].items()}
                for name, entry in workloads.items()
                if part in entry
            }
            fig, ax = plt.subplots(figsize=(10, 4.5))
            _bars(ax, groups, "MB/s (median of rounds, log scale)")
            ax.set_yscale("log")
            ax.set_title(f"{part.upper()} throughput, one client, sequential")
            save(fig, key)
    scale = results.get("scale")
    if scale:
        entries = scale["payloads"]
        fig, axes = plt.subplots(len(entries), 2, figsize=(10, 4 * len(entries)), squeeze=False)
        for (name, entry), (left, right) in zip(entries.items(), axes, strict=True):
            clients = [int(c) for c in entry["levels"]]
            labels = list(next(iter(entry["levels"].values())))
            for label in labels:
                rows = [entry["levels"][str(c)][label] for c in clients]
                left.plot(clients, [r["mb_per_s_median"] for r in rows], marker="o", label=label)
                right.plot(clients, [r["p99_ms"] for r in rows], marker="o", label=label)
            for ax, title in ((left, "aggregate MB/s"), (right, "p99 latency ms")):
                ax.set_xscale("log", base=2)
                ax.set_xticks(clients)
                ax.set_xticklabels([str(c) for c in clients])
                ax.set_xlabel("concurrent clients")
                ax.set_title(f"{name}: {title}")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        save(fig, "scale")
    lookups = results.get("lookups")
    if lookups:
        rows = lookups["rows"]
        fig, ax = plt.subplots(figsize=(10, 4))
        names = [f"{row['what']} x{row['clients']}" for row in rows.values()]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [r["p50_ms"] for r in rows.values()], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [r["p99_ms"] for r in rows.values()], 0.4, label="p99")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
        ax.set_title("HEAD and exists_many latency")
        save(fig, "lookups")
    ev = results.get("eviction")
    start = results.get("startup")
    if ev or start:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        if ev:
            ms = [s * 1e3 for s in ev["raw_seconds"]]
            left.plot(range(1, len(ms) + 1), ms, marker=".", linewidth=0.8)
            left.axvline(ev["capacity_entries"] + 0.5, color="red", linestyle="--")
            left.set_xlabel("PUT number (red: disk full, every PUT evicts from here)")
            left.set_ylabel("PUT ms")
            left.set_title(f"PUT latency as the disk fills ({ev['entry_bytes'] / 2**20:.2g} MiB)")
            left.grid(alpha=0.3)
        if start:
            rows = list(start["rows"].values())
            right.plot(
                [r["entries"] for r in rows],
                [r["time_to_healthz_s"] for r in rows],
                marker="o",
                label="start to /healthz s",
            )
            right.set_xscale("log")
            right.set_xlabel("entries on disk")
            right.set_ylabel("seconds")
            right.set_title("start-up with N entries")
            right.grid(alpha=0.3)
        save(fig, "eviction")
    return written


def latest_markdown(results: dict[str, Any]) -> str:
    """latest.md: every section's tables, the S3 section's last."""
    return markdown(results) + s3_paths.markdown(results)


#: README.md's "Performance" table and sentence, rendered from latest.json.
README_BLOCK = Block(
    "<!-- begin: python -m bench renders this from bench/results/latest.json -->",
    "<!-- end: python -m bench --render rewrites the part above -->",
)
#: The table's rows: (what README.md calls it, the contender in latest.json, whether
#: its ratio to the ceiling is shown).
README_ROWS = (
    ("nginx + urllib3 (ceiling)", GET_REFERENCE, False),
    ("ec-cache disk hit, SDK", "ec-cache SDK, disk hit", True),
    ("ec-cache S3 read-through (cold disk), SDK", "ec-cache SDK, S3 hit", False),
    ("boto3 get_object from the same S3", "boto3 get_object", False),
    ("node-local safetensors load_file", "safetensors load_file (node-local)", False),
)


def readme_block(results: dict[str, Any]) -> str:
    """README.md's "Performance": GET MB/s of each payload but the smallest (a disk hit
    also as a ratio to the ceiling), then the read-through against boto3 on loopback
    and, from the ``s3`` section, behind S3's per-connection link."""
    workloads = {
        name: entry
        for name, entry in results["transfers"]["workloads"].items()
        if entry["entry_bytes"]["max"] >= 1e6
    }
    lines = [
        README_BLOCK.begin,
        provenance.run_line(results["meta"]),
        "",
        "| GET, MB/s (into a CPU tensor) | "
        + " | ".join(_column(entry) for entry in workloads.values())
        + " |",
        "|---|" + "---|" * len(workloads),
    ]
    for label, contender, with_ratio in README_ROWS:
        cells = []
        for entry in workloads.values():
            mbs = entry["get"][contender]["mb_per_s_median"]
            ratio = mbs / entry["get"][GET_REFERENCE]["mb_per_s_median"]
            cells.append(f"{mbs:.0f} ({ratio:.2f}x)" if with_ratio else f"{mbs:.0f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    loopback = [
        entry["get"]["ec-cache SDK, S3 hit"]["mb_per_s_median"]
        / entry["get"]["boto3 get_object"]["mb_per_s_median"]
        for entry in workloads.values()
    ]
    lines += [
        "",
        wrapped(
            "On bare loopback the read-through shares a core with its client "
            f"({s3_paths.ratio_span(loopback)} boto3); {s3_paths.readme_sentence(results['s3'])}"
        ),
        README_BLOCK.end,
    ]
    return "\n".join(lines) + "\n"


def _column(entry: dict[str, Any]) -> str:
    sizes = entry["entry_bytes"]
    if "shape" in entry:
        return f"{sizes['max'] / 1e6:.1f} MB"
    return f"mixed {sizes['min'] / 1e6:.0f}-{sizes['max'] / 1e6:.0f} MB"
