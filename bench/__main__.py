"""``python -m bench``: every benchmark, side by side with the ceilings and alternatives.

Starts SeaweedFS (S3), nginx and ec-cache servers on 127.0.0.1, runs the sections, stops
everything by PID and writes ``latest.json`` (raw numbers), ``latest.md`` (tables,
targets) and PNG plots to ``--out`` (default ``bench/results``); a full run there also
rewrites README.md's "Performance" block (``report.readme_block``).

    python -m bench                # full run, ~10 minutes on the 2-core build box
    python -m bench --quick        # CI smoke run (< 2 minutes): tiny payloads, few rounds
    python -m bench --sections transfers,lookups
    python -m bench --render       # latest.md, plots, README.md's table from latest.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import provenance, put_scale, report, s3_paths, suite
from bench.lifecycle import unwind_on_sigterm
from bench.services import Services

RESULTS = Path(__file__).resolve().parent / "results"
README = RESULTS.parents[1] / "README.md"
SECTIONS: dict[str, Callable[[Services, suite.Plan, Any], dict[str, Any]]] = {
    "transfers": suite.transfers,
    "lookups": suite.lookups,
    "floor": suite.floor,
    "scale": suite.scale,
    "memory": suite.memory,
    "startup": suite.startup,
    "eviction": suite.eviction,
    "s3": s3_paths.section,
    "put_scale": put_scale.put_scale,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="CI smoke run")
    parser.add_argument("--out", type=Path, help="results folder (default bench/results[/quick])")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}"
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="only rewrite latest.md, the plots and README.md's Performance block from "
        "--out's latest.json",
    )
    args = parser.parse_args(argv)
    if args.render:
        out = args.out or RESULTS
        write(out, json.loads((out / "latest.json").read_text()))
        return 0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    out_dir: Path = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = suite.Plan.quick_plan() if args.quick else suite.Plan.full()
    # Large copies through torch's intra-op pool stall when the other core is busy
    # (measured on the 2-core build machines); none of the contenders computes anything.
    torch.set_num_threads(1)
    unwind_on_sigterm()

    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", flush=True)

    results: dict[str, Any] = {
        "meta": {"quick": plan.quick, **provenance.started(suite.machine()), "sections": sections}
    }
    root = Path(tempfile.mkdtemp(prefix="ec-bench-"))
    root.chmod(0o755)  # nginx workers run as an unprivileged user
    services = Services(root)
    try:
        for name in sections:
            log(f"section {name}")
            results[name] = SECTIONS[name](services, plan, log)
    finally:
        services.close()
        shutil.rmtree(root, ignore_errors=True)
    results["targets"] = suite.targets(results) + s3_paths.targets(results)
    provenance.finished(results["meta"], started)
    (out_dir / "latest.json").write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {out_dir / 'latest.json'}, {', '.join(write(out_dir, results))}")
    for row in results["targets"]:
        verdict = "PASS" if row["pass"] else "MISS"
        print(f"  {verdict} {row['ratio']:.2f}x ({row['want']}) {row['target']}")
    return 0


def write(out_dir: Path, results: dict[str, Any]) -> list[str]:
    """latest.md and the plots from ``results``, and README.md's Performance block when
    they are a full run with the sections it shows, in ``bench/results``. Returns what
    it wrote."""
    (out_dir / "latest.md").write_text(report.latest_markdown(results))
    wrote = [str(out_dir / "latest.md"), *map(str, report.plots(results, out_dir))]
    shown = {"transfers", "s3"} <= set(results["meta"]["sections"])
    if out_dir.resolve() == RESULTS.resolve() and not results["meta"]["quick"] and shown:
        README.write_text(
            report.README_BLOCK.replaced(README.read_text(), report.readme_block(results))
        )
        wrote.append(str(README))
    return wrote


if __name__ == "__main__":
    sys.exit(main())
