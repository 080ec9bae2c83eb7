"""Server CPU time per PUT, for server variants side by side (``make bench-put-cpu``).

    python -m bench.put_cpu [--variant NAME=VAR:VALUE+VAR:VALUE ...] [--mb 4.7]
                            [--rounds 6] [--requests 40] [--out FILE.json]

Starts one disk-only ``python -m app`` per variant (each with its own environment:
``VAR:VALUE`` sets a variable, a bare ``VAR`` removes it), then sends sequential PUTs of
new keys from one urllib3 connection to each, in rounds whose order alternates. Prints,
per variant, the medians over rounds of the server process's user and system CPU time
per PUT (from ``/proc/PID/stat``), of the PUT latency and the resulting MB/s. CPU time
moves less than latency on a shared machine. Default variants: the server as it is, and
the same with glibc's allocator thresholds fixed at their initial 128 KiB
(``app.allocator`` leaves them alone when those variables are set).
A focused check, not part of ``make bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch
import urllib3
from safetensors.torch import save

from app.checksum import crc32c
from testkit.server import ServerProcess

DEFAULT_VARIANTS = [
    "server=",
    "glibc-128k=MALLOC_MMAP_THRESHOLD_:131072+MALLOC_TRIM_THRESHOLD_:131072",
]


def _environment(spec: str) -> dict[str, str | None]:
    env: dict[str, str | None] = {}
    for item in filter(None, spec.split("+")):
        name, sep, value = item.partition(":")
        env[name] = value if sep else None
    return env


def _cpu_seconds(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", action="append", help="NAME=VAR:VALUE+VAR (repeatable)")
    parser.add_argument("--mb", type=float, default=4.7, help="body size in MB (bf16 rows of 4096)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=40, help="PUTs per variant per round")
    parser.add_argument("--out", type=Path, help="write the raw per-round figures here")
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in (args.variant or DEFAULT_VARIANTS))
    rows = max(1, round(args.mb * 1e6 / (4096 * 2)))
    data = save({"embedding": torch.randn(rows, 4096).to(torch.bfloat16)})
    headers = {"X-EC-CRC32C": f"{crc32c(data):08x}"}
    print(f"load average at start: {os.getloadavg()}", flush=True)
    raw: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    servers: dict[str, ServerProcess] = {}
    with tempfile.TemporaryDirectory(prefix="ec-put-cpu-") as tmp:
        saved = dict(os.environ)
        try:
            for name, spec in variants.items():
                os.environ.clear()
                os.environ.update(saved)
                for var, value in _environment(spec).items():
                    if value is None:
                        os.environ.pop(var, None)
                    else:
                        os.environ[var] = value
                root = Path(tmp) / name
                root.mkdir()
                servers[name] = ServerProcess(root / "d", root / "log", disk_max_bytes="1GiB")
                servers[name].start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        pools = {
            name: urllib3.HTTPConnectionPool("127.0.0.1", srv.port, maxsize=1)
            for name, srv in servers.items()
        }

        def put(name: str) -> None:
            path = f"/ec/bench/bfloat16/{uuid.uuid4().hex}"
            response = pools[name].request("PUT", path, body=data, headers=headers)
            assert response.status == 201, response.data

        try:
            for name in variants:
                for _ in range(5):
                    put(name)
            for r in range(args.rounds):
                for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
                    proc = servers[name].proc
                    assert proc is not None
                    pid = proc.pid
                    user0, sys0 = _cpu_seconds(pid)
                    latencies = []
                    for _ in range(args.requests):
                        start = time.perf_counter()
                        put(name)
                        latencies.append(time.perf_counter() - start)
                    user1, sys1 = _cpu_seconds(pid)
                    raw[name].append(
                        {
                            "user_ms": (user1 - user0) / args.requests * 1e3,
                            "sys_ms": (sys1 - sys0) / args.requests * 1e3,
                            "p50_ms": statistics.median(latencies) * 1e3,
                        }
                    )
        finally:
            for srv in servers.values():
                srv.stop()
    for name, rounds in raw.items():
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(
            f"{name:16s} server CPU/PUT {med['user_ms'] + med['sys_ms']:6.2f} ms "
            f"(user {med['user_ms']:.2f}, sys {med['sys_ms']:.2f})  "
            f"p50 {med['p50_ms']:6.2f} ms  {len(data) / med['p50_ms'] / 1e3:5.0f} MB/s"
        )
    print(f"load average at end: {os.getloadavg()}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"bytes": len(data), "variants": variants, "raw": raw}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
