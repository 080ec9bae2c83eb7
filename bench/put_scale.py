"""The ``put_scale`` section: PUT ingest under concurrency.

vLLM saves encoder outputs from several threads in every worker, so what matters is the
aggregate rate of many PUTs in flight at once. At 1, 4 and 16 clients (threads of the
benchmark, one keep-alive connection each), every client PUTs new 4.7 MB entries
back to back to:

* nginx WebDAV (urllib3; temp file + rename, no fsync) — the ceiling;
* the ASGI floor (``bench.asgi_floor``, urllib3): uvicorn on ec-cache's options
  receiving and dropping the body — what one uvicorn process can take in at all;
* ec-cache disk only and ec-cache write-back (S3 = the benchmark's SeaweedFS), each
  through the SDK (``Client.put``: conditional, ``Expect: 100-continue``) and through
  urllib3 (a plain PUT with ``X-EC-CRC32C``: the server's share).

Rounds are interleaved (order rotates and reverses); throughput is the median over
rounds of bytes / wall time of the whole level. Keys are removed (and the write-back
queue drained) after each run, outside the timed part. Each run also records the
server's CPU seconds and, when the server exports them, its group-commit counters
(``ec_disk_commit_*``): how many entries each durability batch covered.
"""

from __future__ import annotations

import itertools
import os
import re
import urllib.request
from collections.abc import Callable
from typing import Any

import ec_cache
import urllib3

from app.checksum import crc32c, to_hex
from bench.payloads import DTYPE, FULL_PAYLOADS, MODEL, QUICK_PAYLOADS
from bench.provenance import load_average
from bench.runner import concurrent
from bench.services import Services, wait_upload_queue_empty
from bench.stats import median, percentile, target_row

NGINX = "nginx DAV PUT"
FLOOR = "ASGI floor PUT (receive only, urllib3)"
DISK_SDK = "ec-cache SDK PUT, disk only"
DISK_URLLIB3 = "ec-cache urllib3 PUT, disk only"
WB_SDK = "ec-cache SDK PUT, write-back"
WB_URLLIB3 = "ec-cache urllib3 PUT, write-back"
CLIENTS = (1, 4, 16)
#: The issue's target: >= this fraction of nginx's aggregate MB/s at 16 clients.
TARGET_RATIO = 0.6
TARGET_CLIENTS = 16
#: The contenders' server name for the ASGI floor (it stores nothing).
FLOOR_SERVER = "floor"
_TICKS = os.sysconf("SC_CLK_TCK")
_COMMIT_RE = re.compile(r"^(ec_disk_commit_\w+?)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)


def _cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and of its children still running (nginx workers)."""
    total = 0.0
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICKS
    return total


def _commit_counters(url: str) -> dict[str, float]:
    """The server's ``ec_disk_commit_*`` samples (empty for a server without them)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for name, value in _COMMIT_RE.findall(text):
        if name.endswith("_bucket"):
            continue
        out[name] = out.get(name, 0.0) + float(value)
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def put_scale(svc: Services, plan: Any, log: Any) -> dict[str, Any]:
    """Aggregate PUT MB/s at 1, 4 and 16 clients: disk only and write-back vs nginx."""
    payload = QUICK_PAYLOADS[1] if plan.quick else FULL_PAYLOADS[1]
    rounds = 1 if plan.quick else 5
    requests = 8 if plan.quick else 48  # per level and contender, at least 4 per client
    tensor = payload.tensor(seed=77)
    body = payload.body(tensor)
    crc_hex = to_hex(crc32c(body))
    most = max(CLIENTS)

    nginx = svc.nginx()
    disk_srv = svc.server("put-scale-disk", disk_max_bytes="20GiB", max_body_bytes="1GiB")
    wb_srv = svc.server(
        "put-scale-wb",
        s3_prefix="ec-put-scale",
        disk_max_bytes="20GiB",
        max_body_bytes="1GiB",
        write_mode="write-back",
    )
    floor_file = svc.root / "put-scale-floor.safetensors"  # served by GET: unused here
    floor_file.write_bytes(body)
    floor_srv = svc.asgi_floor("put-scale", floor_file)
    servers = {"disk": disk_srv, "wb": wb_srv}
    weed = svc.s3().managed
    s3_pid = weed.proc.pid if weed is not None and weed.proc is not None else None
    sdk = {
        name: ec_cache.Client(
            srv.url, model=MODEL, dtype=DTYPE, limits=ec_cache.Limits(max_keepalive=most)
        )
        for name, srv in servers.items()
    }
    pools = {
        name: urllib3.HTTPConnectionPool("127.0.0.1", srv.port, maxsize=most, block=True)
        for name, srv in servers.items()
    }
    dav = urllib3.HTTPConnectionPool("127.0.0.1", nginx.port, maxsize=most, block=True)
    floor = urllib3.HTTPConnectionPool("127.0.0.1", floor_srv.port, maxsize=most, block=True)
    counter = itertools.count()
    written: dict[str, list[str]] = {}

    def new_key(label: str) -> str:
        key = f"put-scale-{label}-{next(counter)}"
        written.setdefault(label, []).append(key)
        return key

    def nginx_put(_: int, __: int) -> int:
        response = dav.request("PUT", f"/dav/{new_key('dav')}", body=body)
        if response.status not in (201, 204):
            raise RuntimeError(f"nginx DAV PUT: {response.status}")
        return len(body)

    def floor_put(_: int, __: int) -> int:
        response = floor.request("PUT", "/ec/floor", body=body)
        if response.status != 201:
            raise RuntimeError(f"ASGI floor PUT: {response.status}")
        return len(body)

    def sdk_put(server: str) -> Callable[[int, int], int]:
        client = sdk[server]

        def op(_: int, __: int) -> int:
            if not client.put(new_key(server), tensor):
                raise RuntimeError("PUT did not create the entry")
            return len(body)

        return op

    def urllib3_put(server: str) -> Callable[[int, int], int]:
        pool = pools[server]
        headers = {"X-EC-CRC32C": crc_hex, "Content-Type": "application/octet-stream"}

        def op(_: int, __: int) -> int:
            path = f"/ec/{MODEL}/{DTYPE}/{new_key(server)}"
            response = pool.request("PUT", path, body=body, headers=headers)
            if response.status != 201:
                raise RuntimeError(f"ec-cache PUT: {response.status} {response.data[:200]!r}")
            return len(body)

        return op

    def cleanup(server: str | None) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if server == FLOOR_SERVER:
            return extra
        label = server or "dav"
        keys, written[label] = written.get(label, []), []
        if server is None:
            for key in keys:
                dav.request("DELETE", f"/dav/{key}")
            return extra
        if server == "wb":
            extra["upload_queue_drain_s"] = round(wait_upload_queue_empty(wb_srv.url), 3)
        for key in keys:
            pools[server].request("DELETE", f"/ec/{MODEL}/{DTYPE}/{key}")
        return extra

    # label -> (op, server name or None for nginx, pid whose CPU is counted)
    assert nginx.proc is not None and disk_srv.proc is not None and wb_srv.proc is not None
    assert floor_srv.proc is not None
    contenders: dict[str, tuple[Callable[[int, int], int], str | None, int]] = {
        NGINX: (nginx_put, None, nginx.proc.pid),
        FLOOR: (floor_put, FLOOR_SERVER, floor_srv.proc.pid),
        DISK_SDK: (sdk_put("disk"), "disk", disk_srv.proc.pid),
        DISK_URLLIB3: (urllib3_put("disk"), "disk", disk_srv.proc.pid),
        WB_SDK: (sdk_put("wb"), "wb", wb_srv.proc.pid),
        WB_URLLIB3: (urllib3_put("wb"), "wb", wb_srv.proc.pid),
    }
    # Every contender stores the same bytes: check one of each before timing anything.
    for label, (op, server, _) in contenders.items():
        op(0, 0)
        if server == FLOOR_SERVER:
            continue  # stores nothing
        key = written[server or "dav"][-1]
        if server is None:
            got = dav.request("GET", f"/dav/{key}").data
        else:
            got = pools[server].request("GET", f"/ec/{MODEL}/{DTYPE}/{key}").data
        if got != body:
            raise RuntimeError(f"{label}: stored other bytes")
        cleanup(server)

    levels: dict[str, Any] = {}
    out: dict[str, Any] = {
        "payload": payload.name,
        "entry_bytes": len(body),
        "rounds": rounds,
        "clients_are": "threads of the benchmark process, one keep-alive connection each",
        "servers": {
            "disk": "no S3, disk 20 GiB",
            "wb": "write-back to SeaweedFS; uploads run while PUTs come in, queue drained "
            "after each run (untimed)",
        },
        "loadavg_before": load_average(),
        "levels": levels,
    }
    try:
        for clients in CLIENTS:
            per_client = max(4, requests // clients)
            for op, _, _ in contenders.values():  # open the connections of this level
                concurrent(op, clients, 1)
            for _, server, _ in contenders.values():
                cleanup(server)
            raw: dict[str, list[dict[str, Any]]] = {label: [] for label in contenders}
            for round_index in range(rounds):
                order = list(contenders)
                shift = round_index % len(order)
                order = order[shift:] + order[:shift]
                if round_index % 2:
                    order.reverse()
                for label in order:
                    op, server, pid = contenders[label]
                    url = servers[server].url if server in servers else None
                    commits = _commit_counters(url) if url else {}
                    cpu = _cpu_seconds(pid)
                    s3_cpu = _cpu_seconds(s3_pid) if s3_pid is not None else 0.0
                    wall, seconds, moved = concurrent(op, clients, per_client)
                    run: dict[str, Any] = {
                        "wall_s": round(wall, 6),
                        "bytes": moved,
                        "mb_per_s": moved / wall / 1e6,
                        "server_cpu_s": round(_cpu_seconds(pid) - cpu, 3),
                        "raw_seconds": [round(s, 6) for s in seconds],
                    }
                    if server == "wb" and s3_pid is not None:
                        # uploads that ran during the timed part, on the same CPUs
                        run["s3_cpu_s"] = round(_cpu_seconds(s3_pid) - s3_cpu, 3)
                    if url:
                        run["commit"] = _delta(_commit_counters(url), commits)
                    run.update(cleanup(server))
                    raw[label].append(run)
            level: dict[str, Any] = {}
            for label, runs in raw.items():
                flat = [s for run in runs for s in run["raw_seconds"]]
                moved_gb = sum(run["bytes"] for run in runs) / 1e9
                level[label] = {
                    "mb_per_s_median": median([run["mb_per_s"] for run in runs]),
                    "mb_per_s_rounds": [round(run["mb_per_s"], 1) for run in runs],
                    "p50_ms": median(flat) * 1e3,
                    "p99_ms": percentile(flat, 99) * 1e3,
                    "requests": len(flat),
                    "server_cpu_s_per_gb": sum(run["server_cpu_s"] for run in runs) / moved_gb,
                    "s3_cpu_s_per_gb": (
                        sum(run["s3_cpu_s"] for run in runs) / moved_gb
                        if all("s3_cpu_s" in run for run in runs)
                        else None
                    ),
                    "runs": runs,
                }
            levels[str(clients)] = level
            log(f"put_scale: {clients} clients done")
    finally:
        for client in sdk.values():
            client.close()
        for pool in (*pools.values(), dav, floor):
            pool.close()
        svc.stop_server(floor_srv)
        svc.stop_server(wb_srv)
        svc.stop_server(disk_srv)
    out["loadavg_after"] = load_average()
    return out


def _batch(run_rows: list[dict[str, Any]]) -> str:
    """Entries per durability batch over the runs, from the commit counters."""
    entries = sum(run.get("commit", {}).get("ec_disk_commit_batch_size_sum", 0) for run in run_rows)
    batches = sum(
        run.get("commit", {}).get("ec_disk_commit_batch_size_count", 0) for run in run_rows
    )
    return f"{entries / batches:.1f}" if batches else "-"


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per ec-cache contender at 16 clients: >= 0.6x nginx's aggregate MB/s."""
    section = results.get("put_scale")
    if not section:
        return []
    level = section["levels"].get(str(TARGET_CLIENTS))
    if not level:
        return []
    return [
        target_row(
            f"{label} vs {NGINX}, {TARGET_CLIENTS} clients, aggregate",
            TARGET_RATIO,
            level[label]["mb_per_s_median"],
            level[NGINX]["mb_per_s_median"],
        )
        for label in (DISK_SDK, WB_SDK, DISK_URLLIB3, WB_URLLIB3)
    ]


def markdown(results: dict[str, Any]) -> list[str]:
    section = results.get("put_scale")
    if not section:
        return []
    out = [
        "## PUT under concurrency",
        "",
        f"{section['clients_are']}; every PUT a new {section['entry_bytes'] / 1e6:.3g} MB "
        f"entry; median of {section['rounds']} interleaved rounds of the aggregate MB/s. "
        f"Load {section['loadavg_before']} -> {section['loadavg_after']}. `per batch`: "
        "entries made durable per group commit (server counter). `vs floor`: against "
        "uvicorn receiving and dropping the same bodies (`bench/asgi_floor.py`). `S3 CPU`: "
        "what SeaweedFS spent, on the same CPUs, taking the write-back uploads that ran "
        "during the timed part.",
        "",
        "| clients | contender | MB/s (aggregate) | vs nginx | vs floor | p50 ms | p99 ms | "
        "server CPU s/GB | S3 CPU s/GB | per batch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for clients, level in section["levels"].items():
        reference = level[NGINX]["mb_per_s_median"]
        floor = level.get(FLOOR, {}).get("mb_per_s_median")
        for label, row in level.items():
            mbs = row["mb_per_s_median"]
            vs_floor = f"{mbs / floor:.2f}x" if floor else "-"
            s3_cpu = row.get("s3_cpu_s_per_gb")
            s3_column = f"{s3_cpu:.2f}" if s3_cpu is not None else "-"
            out.append(
                f"| {clients} | {label} | {mbs:.0f} | {mbs / reference:.2f}x | {vs_floor} | "
                f"{row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
                f"{row['server_cpu_s_per_gb']:.2f} | {s3_column} | {_batch(row['runs'])} |"
            )
    out.append("")
    return out
