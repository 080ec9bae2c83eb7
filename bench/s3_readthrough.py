"""Read-through from S3 behind a per-connection link: the issue-49 target table, in one
command (``python -m bench.s3_readthrough``; needs tc and CAP_NET_ADMIN, see
``bench/s3_link.py``).

The ec-cache servers get CPUs of their own (the first half; a replica has its node),
S3 (a SeaweedFS of its own) and the benchmark client share the others, so that boto3
and the read-through's client meet the same S3 on the same cores (on 2 CPUs: servers on
one, S3 and client on the other; ``--layout s3-alone`` gives S3 the last CPU and the
client and servers the rest, as the ``s3`` section does). S3 is reached through
:class:`bench.s3_link.ConnectionLink`: each connection at ~90 MB/s, all behind
a 10 Gbit/s node link. In one run, on that link:

1. **link check**: boto3 ``get_object`` of the largest object over one connection, and
   ``LINK_STREAMS`` such GETs at once (aggregate MB/s): one stream should measure ~90
   MB/s, N streams ~N times that until the cores bind;
2. per payload (Qwen2.5-VL 19.3 MB, Qwen3-VL 66.8 MB), the disk tier empty for every
   GET (``ColdCycle``: three keys, disk room for one), interleaved round by round:
   * read-through GET to the client (urllib3, whole body), ranged parts
     (``EC_S3_GET_CONCURRENCY`` default);
   * the same with one GET per object (``EC_S3_GET_CONCURRENCY=1``, the old path);
   * the SDK's ``get`` through the ranged read-through;
   * boto3 TransferManager ``download_fileobj`` (max_concurrency=8, 8 MiB parts) of
     the same object into memory;
   with the server's CPU-seconds per GB read through (``/proc/<pid>/stat``, before and
   after each contender's round).

Output: a markdown table on stdout and ``s3-readthrough.json`` / ``.md`` under
``--out``. Medians of the rounds' MB/s with their min-max; the machine must be quiet
(no tests or other benchmarks) for figures worth publishing.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ec_cache
import urllib3
from boto3.s3.transfer import TransferConfig

from app.settings import Settings
from bench import provenance, s3_link, suite
from bench.contenders import ColdCycle, boto3_client
from bench.payloads import DTYPE, MODEL, Payload
from bench.s3_paths import cpu_seconds, pin_process
from bench.stats import median
from testkit.s3 import S3Endpoint, seaweedfs_endpoint
from testkit.server import ServerProcess

BUCKET = "ec-bench-readthrough"
PREFIX = "ec-rt"
MiB = 1024 * 1024
PAYLOADS = [
    Payload("qwen25vl-2691x3584", (2691, 3584), "Qwen2.5-VL-7B 1080p, 19.3 MB"),
    Payload("qwen3vl-2040x16384", (2040, 16384), "Qwen3-VL-8B 1080p, 66.8 MB"),
]
LINK_STREAMS = 8
#: What one connection should measure behind the link (its 90 MB/s, give or take).
ONE_STREAM_MB_S = (75.0, 100.0)
RANGED = "read-through GET, ranged parts"
SINGLE = "read-through GET, one stream (before)"
SDK = "SDK get, ranged read-through"
TRANSFER = "boto3 TransferManager download_fileobj (8 x 8 MiB)"
LAYOUTS = ("server-alone", "s3-alone")
TRANSFER_CONFIG = TransferConfig(
    multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB, max_concurrency=8
)


@dataclass(frozen=True)
class Placement:
    """Which CPUs the servers, S3 and the client run on (empty: not pinned)."""

    servers: set[int] = field(default_factory=set)
    s3: set[int] = field(default_factory=set)
    client: set[int] = field(default_factory=set)

    @classmethod
    def plan(cls, layout: str) -> Placement:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
        if len(cpus) < 2:
            return cls()
        if layout == "s3-alone":
            return cls(set(cpus[:-1]), {cpus[-1]}, set(cpus[:-1]))
        half = len(cpus) // 2
        return cls(set(cpus[:half]), set(cpus[half:]), set(cpus[half:]))

    def describe(self) -> str:
        if not self.servers:
            return "NOT pinned (one CPU or no sched_setaffinity)"
        return (
            f"ec-cache servers on CPU {sorted(self.servers)}, S3 on {sorted(self.s3)}, "
            f"benchmark client on {sorted(self.client)}"
        )


def _server(
    root: Path, name: str, endpoint: S3Endpoint, cpus: Placement, **env: Any
) -> ServerProcess:
    proc = ServerProcess(root / name, root / f"{name}.log", **env)
    proc.env.update(endpoint.env(prefix=PREFIX))
    proc.start()
    assert proc.proc is not None
    if cpus.servers:
        pin_process(proc.proc.pid, cpus.servers)
    return proc


def link_check(s3: Any, key: str, size: int) -> dict[str, Any]:
    """MB/s of one ``get_object``, and of ``LINK_STREAMS`` at once (each its own
    connection), over the shaped link."""

    def one() -> None:
        s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    started = time.perf_counter()
    one()
    single = size / (time.perf_counter() - started) / 1e6
    threads = [threading.Thread(target=one) for _ in range(LINK_STREAMS)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    many = LINK_STREAMS * size / (time.perf_counter() - started) / 1e6
    return {
        "one_stream_mb_per_s": single,
        f"{LINK_STREAMS}_streams_mb_per_s": many,
        # The model holds when one connection gets about its share and several get
        # about as many shares (until the cores bind: then say so, not fail).
        "one_stream_as_modelled": ONE_STREAM_MB_S[0] <= single <= ONE_STREAM_MB_S[1],
        "streams_scaling": many / single,
    }


def measure(
    payload: Payload,
    contenders: dict[str, tuple[Callable[[], None], Callable[[], None], int | None]],
    rounds: int,
    count: int,
) -> dict[str, Any]:
    """Interleaved rounds of ``count`` requests per contender: (request, untimed settle
    before it, server pid or None)."""
    seconds: dict[str, list[float]] = {label: [] for label in contenders}
    cpu: dict[str, float] = dict.fromkeys(contenders, 0.0)
    for _ in range(rounds):
        for label, (request, settle, pid) in contenders.items():
            total = 0.0
            for _ in range(count):
                settle()
                before = cpu_seconds(pid) if pid else 0.0
                started = time.perf_counter()
                request()
                total += time.perf_counter() - started
                if pid:
                    cpu[label] += cpu_seconds(pid) - before
            seconds[label].append(total / count)
    out: dict[str, Any] = {}
    moved_gb = payload.size * rounds * count / 1e9
    for label, per_round in seconds.items():
        rates = [payload.size / s / 1e6 for s in per_round]
        row: dict[str, Any] = {
            "mb_per_s_median": median(rates),
            "mb_per_s_min": min(rates),
            "mb_per_s_max": max(rates),
            "mb_per_s_rounds": [round(r, 1) for r in rates],
        }
        if contenders[label][2]:
            row["server_cpu_s_per_gb"] = cpu[label] / moved_gb
        out[label] = row
    return out


def run(rounds: int, count: int, root: Path, layout: str, argv: list[str]) -> dict[str, Any]:
    why_not = s3_link.why_not()
    if why_not:
        raise SystemExit(f"cannot shape the S3 link here: {why_not}")
    started = time.monotonic()
    meta: dict[str, Any] = {
        "command": "python -m bench.s3_readthrough" + "".join(f" {a}" for a in argv),
        **provenance.started(suite.machine()),
    }
    iso = Placement.plan(layout)
    everything = set(os.sched_getaffinity(0)) if iso.servers else set()
    # What the ranged server runs with (the environment's EC_* included).
    settings = Settings()
    results: dict[str, Any] = {
        "meta": meta,
        "isolation": iso.describe(),
        "ranged_parts": {
            "part_size": int(settings.s3_get_part_size),
            "concurrency": settings.s3_get_concurrency,
        },
        "payloads": {},
    }
    with seaweedfs_endpoint(root / "seaweedfs", BUCKET) as endpoint:
        weed = endpoint.managed
        assert weed is not None and weed.proc is not None
        if iso.servers:
            pin_process(weed.proc.pid, iso.s3)
            pin_process(os.getpid(), iso.client)
        s3 = boto3_client(endpoint.endpoint_url, endpoint.access_key, endpoint.secret_key)
        servers: list[ServerProcess] = []
        try:
            writer = _server(root, "writer", endpoint, iso, disk_max_bytes="2GiB")
            servers.append(writer)
            put_client = ec_cache.Client(writer.url, model=MODEL, dtype=DTYPE)
            for payload in PAYLOADS:
                keys = [f"{payload.name}-rt-{k}" for k in range(3)]
                for k, key in enumerate(keys):
                    assert put_client.put(key, payload.tensor(seed=20 + k))
            objects = {
                p.name: [f"{PREFIX}/{MODEL}/{DTYPE}/{p.name}-rt-{k}.safetensors" for k in range(3)]
                for p in PAYLOADS
            }
            link = s3_link.ConnectionLink(weed.s3_port)
            results["link"] = link.describe()
            with link:
                largest = PAYLOADS[-1]
                results["link_check"] = link_check(s3, objects[largest.name][0], largest.size)
                for payload in PAYLOADS:
                    results["payloads"][payload.name] = _payload(
                        root,
                        endpoint,
                        iso,
                        s3,
                        payload,
                        objects[payload.name],
                        rounds,
                        count,
                        servers,
                    )
        finally:
            for server in servers:
                server.stop()
            if everything:
                pin_process(os.getpid(), everything)
    provenance.finished(meta, started)
    return results


def _payload(
    root: Path,
    endpoint: S3Endpoint,
    iso: Placement,
    s3: Any,
    payload: Payload,
    objects: list[str],
    rounds: int,
    count: int,
    servers: list[ServerProcess],
) -> dict[str, Any]:
    keys = [f"{payload.name}-rt-{k}" for k in range(3)]
    room = str(payload.size)  # one entry: every GET of the cycle misses the disk
    ranged = _server(root, f"ranged-{payload.name}", endpoint, iso, disk_max_bytes=room)
    single = _server(
        root, f"single-{payload.name}", endpoint, iso, disk_max_bytes=room, s3_get_concurrency=1
    )
    servers += [ranged, single]
    sdk_client = ec_cache.Client(ranged.url, model=MODEL, dtype=DTYPE)
    cycles = {RANGED: ColdCycle(keys, ranged.data_dir), SINGLE: ColdCycle(keys, single.data_dir)}
    pools = {
        RANGED: urllib3.HTTPConnectionPool("127.0.0.1", ranged.port, maxsize=1),
        SINGLE: urllib3.HTTPConnectionPool("127.0.0.1", single.port, maxsize=1),
    }
    # The SDK shares the ranged server's cycle: each of its GETs misses the disk too.
    sdk_cycle = cycles[RANGED]
    boto_turn = iter(range(1 << 30))

    def http_get(label: str) -> Callable[[], None]:
        def request() -> None:
            key = cycles[label].next_key()
            resp = pools[label].urlopen("GET", f"/ec/{MODEL}/{DTYPE}/{key}", preload_content=True)
            if resp.status != 200 or len(resp.data) != payload.size:
                raise RuntimeError(f"{label}: {resp.status}, {len(resp.data)} bytes")

        return request

    def sdk_get() -> None:
        if sdk_client.get(sdk_cycle.next_key()) is None:
            raise RuntimeError("SDK get missed")

    def transfer() -> None:
        out = io.BytesIO()
        s3.download_fileobj(BUCKET, objects[next(boto_turn) % 3], out, Config=TRANSFER_CONFIG)
        if out.getbuffer().nbytes != payload.size:
            raise RuntimeError(f"TransferManager got {out.getbuffer().nbytes} bytes")

    def pid(proc: ServerProcess) -> int | None:
        return proc.proc.pid if proc.proc is not None else None

    # Warm-up, untimed: connections, imports, the first fill of each server.
    for request, cycle in ((http_get(RANGED), cycles[RANGED]), (http_get(SINGLE), cycles[SINGLE])):
        cycle.settle()
        request()
    transfer()
    contenders = {
        RANGED: (http_get(RANGED), cycles[RANGED].settle, pid(ranged)),
        SINGLE: (http_get(SINGLE), cycles[SINGLE].settle, pid(single)),
        SDK: (sdk_get, sdk_cycle.settle, pid(ranged)),
        TRANSFER: (transfer, lambda: None, None),
    }
    out = measure(payload, contenders, rounds, count)
    out["entry_bytes"] = payload.size
    return out


def markdown(results: dict[str, Any]) -> str:
    check = results["link_check"]
    parts = results["ranged_parts"]
    lines = [
        "## S3 read-through behind a per-connection link",
        "",
        f"`{results['meta']['command']}`. {provenance.run_line(results['meta'])}",
        "",
        f"Link: {results['link']}. Isolation: {results['isolation']}. Ranged parts: "
        f"{parts['part_size'] / 2**20:g} MiB, {parts['concurrency']} at once.",
        f"Link check: one connection {check['one_stream_mb_per_s']:.0f} MB/s "
        f"({'as modelled' if check['one_stream_as_modelled'] else 'NOT as modelled'}: "
        f"{ONE_STREAM_MB_S[0]:.0f}-{ONE_STREAM_MB_S[1]:.0f}), {LINK_STREAMS} at once "
        f"{check[f'{LINK_STREAMS}_streams_mb_per_s']:.0f} MB/s "
        f"({check['streams_scaling']:.1f}x one; {LINK_STREAMS}x unless the cores bind).",
        "",
        "| entry | contender | MB/s median (min-max) | x TransferManager | server CPU-s/GB |",
        "|---|---|---|---|---|",
    ]
    for name, rows in results["payloads"].items():
        reference = rows[TRANSFER]["mb_per_s_median"]
        for label in (RANGED, SINGLE, SDK, TRANSFER):
            row = rows[label]
            cpu = row.get("server_cpu_s_per_gb")
            lines.append(
                f"| {name} ({rows['entry_bytes'] / 1e6:.1f} MB) | {label} | "
                f"{row['mb_per_s_median']:.0f} ({row['mb_per_s_min']:.0f}-"
                f"{row['mb_per_s_max']:.0f}) | {row['mb_per_s_median'] / reference:.2f} | "
                f"{'-' if cpu is None else f'{cpu:.2f}'} |"
            )
        speedup = rows[RANGED]["mb_per_s_median"] / rows[SINGLE]["mb_per_s_median"]
        lines.append(f"| {name} | ranged / one stream | {speedup:.2f}x | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.s3_readthrough", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    parser.add_argument("--count", type=int, default=3, help="requests per round (3)")
    parser.add_argument("--out", type=Path, default=None, help="folder for .json and .md")
    parser.add_argument(
        "--layout", choices=LAYOUTS, default=LAYOUTS[0], help="CPU placement (server-alone)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ec-bench-rt-") as tmp:
        results = run(
            args.rounds, args.count, Path(tmp), args.layout, sys.argv[1:] if argv is None else argv
        )
    text = markdown(results)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "s3-readthrough.json").write_text(json.dumps(results, indent=2))
        (args.out / "s3-readthrough.md").write_text(text)


if __name__ == "__main__":
    main()
