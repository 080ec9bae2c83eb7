"""Disk-hit GET of ec-cache against nginx serving the same bytes, same client, one run.

    python -m bench.disk_get [--rounds 7] [--requests 20] [--sizes 4718672,16777216]

Both servers are started on 127.0.0.1 and stopped at the end. The client is urllib3
over one keep-alive connection per contender; rounds alternate which goes first.
Results (raw per-request seconds, medians, p99, ratios) go to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import urllib3

from bench.nginx import Nginx
from bench.stats import median, percentile
from tests.support.entries import body
from tests.support.server import ServerProcess

RESULTS = Path(__file__).parent / "results"


def _time_gets(pool: urllib3.HTTPConnectionPool, path: str, size: int, n: int) -> list[float]:
    seconds = []
    for _ in range(n):
        start = time.perf_counter()
        response = pool.request("GET", path, preload_content=True)
        data = response.data
        seconds.append(time.perf_counter() - start)
        if response.status != 200 or len(data) != size:
            raise RuntimeError(f"GET {path}: {response.status}, {len(data)} bytes")
    return seconds


def run(sizes: list[int], rounds: int, requests: int) -> dict[str, Any]:
    results: dict[str, Any] = {"sizes": {}}
    with tempfile.TemporaryDirectory(prefix="ec-bench-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # nginx workers run as an unprivileged user
        with (
            Nginx(root / "nginx") as nginx,
            ServerProcess(
                root / "ec-data", root / "ec.log", disk_max_bytes="4GiB", max_body_bytes="1GiB"
            ) as ec,
        ):
            for size in sizes:
                data = body((size - 80,), "U8", 1)  # an 80-byte header: total = size
                name = f"payload-{size}"
                (nginx.www / name).write_bytes(data)
                put = urllib3.request("PUT", f"{ec.url}/ec/bench/uint8/{name}", body=data)
                assert put.status in (200, 201), put.status
                contenders = {
                    "nginx+urllib3": (
                        urllib3.HTTPConnectionPool("127.0.0.1", nginx.port),
                        f"/{name}",
                    ),
                    "ec-cache+urllib3": (
                        urllib3.HTTPConnectionPool("127.0.0.1", ec.port),
                        f"/ec/bench/uint8/{name}",
                    ),
                }
                raw: dict[str, list[list[float]]] = {label: [] for label in contenders}
                for pool, path in contenders.values():
                    _time_gets(pool, path, len(data), 3)  # warm up connection and page cache
                for round_index in range(rounds):
                    order = list(contenders) if round_index % 2 == 0 else list(reversed(contenders))
                    for label in order:
                        pool, path = contenders[label]
                        raw[label].append(_time_gets(pool, path, len(data), requests))
                summary: dict[str, dict[str, Any]] = {}
                for label, runs in raw.items():
                    per_round = [len(data) * len(r) / sum(r) / 1e6 for r in runs]
                    flat = [s for r in runs for s in r]
                    summary[label] = {
                        "mb_per_s_median": median(per_round),
                        "mb_per_s_rounds": per_round,
                        "p50_ms": median(flat) * 1e3,
                        "p99_ms": percentile(flat, 99) * 1e3,
                        "raw_seconds": runs,
                    }
                ratio = (
                    summary["ec-cache+urllib3"]["mb_per_s_median"]
                    / summary["nginx+urllib3"]["mb_per_s_median"]
                )
                results["sizes"][str(len(data))] = {"contenders": summary, "ratio_vs_nginx": ratio}
    results["machine"] = {"python": platform.python_version(), "node": platform.node()}
    return results


def table(results: dict[str, Any]) -> str:
    lines = [
        "| payload | nginx+urllib3 MB/s | ec-cache+urllib3 MB/s | ratio | ec-cache p50 / p99 ms |",
        "|---|---|---|---|---|",
    ]
    for size, entry in results["sizes"].items():
        n, e = entry["contenders"]["nginx+urllib3"], entry["contenders"]["ec-cache+urllib3"]
        lines.append(
            f"| {int(size) / 1e6:.1f} MB | {n['mb_per_s_median']:.0f} | {e['mb_per_s_median']:.0f} "
            f"| {entry['ratio_vs_nginx']:.2f}x | {e['p50_ms']:.2f} / {e['p99_ms']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="4718672,16777216", help="payload sizes in bytes, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per contender")
    parser.add_argument("--requests", type=int, default=20, help="sequential GETs per round")
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "disk_get.json", help="raw JSON output"
    )
    args = parser.parse_args()
    results = run([int(s) for s in args.sizes.split(",")], args.rounds, args.requests)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"raw results: {args.out}")


if __name__ == "__main__":
    main()
