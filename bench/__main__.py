"""``python -m bench``: every benchmark, side by side with the ceilings and alternatives.

Starts SeaweedFS (S3), nginx and ec-cache servers on 127.0.0.1, runs the sections, stops
everything by PID and writes ``latest.json`` (raw numbers), ``latest.md`` (tables,
targets) and PNG plots to ``--out`` (default ``bench/results``).

    python -m bench                # full run, ~10 minutes on the 2-core build box
    python -m bench --quick        # CI smoke run (< 2 minutes): tiny payloads, few rounds
    python -m bench --sections transfers,lookups
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
    args = parser.parse_args(argv)
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
    (out_dir / "latest.md").write_text(report.markdown(results) + s3_paths.markdown(results))
    plots = report.plots(results, out_dir)
    log(f"wrote {out_dir / 'latest.json'}, {out_dir / 'latest.md'}, {len(plots)} plots")
    for row in results["targets"]:
        verdict = "PASS" if row["pass"] else "MISS"
        print(f"  {verdict} {row['ratio']:.2f}x ({row['want']}) {row['target']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
