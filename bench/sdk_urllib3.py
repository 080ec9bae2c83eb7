"""The SDK against urllib3 on the same ec-cache server, same run (``make bench-sdk-urllib3``).

    python -m bench.sdk_urllib3 [--clients 1,4,16,64] [--sizes 4.7,19.3] [--rounds 5]
                                [--requests 64] [--only threads|tasks] [--no-verify]

One ``python -m app`` on 127.0.0.1 holds one entry per size. For each concurrency:
``clients`` threads sharing one ``ec_cache.Client`` (``get`` into a fresh CPU tensor,
CRC32C checked unless ``--no-verify``: urllib3 checks nothing, so that option shows what
the check costs), ``clients`` asyncio tasks sharing one ``ec_cache.AsyncClient``, and
``clients`` threads sharing one ``urllib3.PoolManager`` (``.data``), in rounds whose
order alternates. Prints the median aggregate MB/s of each, the SDK's ratio to
urllib3, and the client process's CPU time per GET (all its threads; the server is
another process): on a loaded machine the CPU figures move less than the rates. A
focused check of issue 13's target, not part of ``make bench``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import ec_cache
import torch
import urllib3

from bench.runner import EventLoopThread, concurrent, concurrent_tasks
from testkit.server import ServerProcess

MODEL, DTYPE = "bench", "bfloat16"
SHAPES = {"4.7": (576, 4096), "19.3": (2691, 3584), "67": (2040, 16384)}  # bf16 MB


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--sizes", default="4.7", help=f"MB, of {', '.join(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=64, help="per round (at least 2 a client)")
    parser.add_argument("--only", choices=("threads", "tasks"), help="one SDK contender")
    parser.add_argument(
        "--no-verify", action="store_true", help="SDK clients with verify=False (no CRC32C)"
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    most = max(levels)
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ec-sdk-urllib3-") as tmp:
        root = Path(tmp)
        srv = ServerProcess(root / "d", root / "log", disk_max_bytes="2GiB").start()
        loop = EventLoopThread()
        limits = ec_cache.Limits(max_keepalive=most, concurrency=most)
        verify = not args.no_verify
        client = ec_cache.Client(srv.url, model=MODEL, dtype=DTYPE, limits=limits, verify=verify)
        aclient = ec_cache.AsyncClient(
            srv.url, model=MODEL, dtype=DTYPE, limits=limits, verify=verify
        )
        pool = urllib3.PoolManager(maxsize=most, block=True)
        try:
            for size in args.sizes.split(","):
                tensor = torch.randn(SHAPES[size]).to(torch.bfloat16)
                key = f"sdk-urllib3-{size}"
                client.put(key, tensor)
                url = f"{srv.url}/ec/{MODEL}/{DTYPE}/{key}"
                nbytes = len(pool.request("GET", url).data)
                got = loop.run(aclient.get(key))
                assert got is not None and torch.equal(got, tensor)

                def sdk(_: int, __: int, key: str = key, n: int = nbytes) -> int:
                    assert client.get(key) is not None
                    return n

                async def sdk_async(_: int, __: int, key: str = key, n: int = nbytes) -> int:
                    assert await aclient.get(key) is not None
                    return n

                def plain(_: int, __: int, url: str = url) -> int:
                    return len(pool.request("GET", url).data)

                Run = Callable[[int, int], tuple[float, list[float], int]]
                contenders: dict[str, Run] = {"urllib3": lambda c, k: concurrent(plain, c, k)}
                if args.only != "tasks":
                    contenders["SDK threads"] = lambda c, k: concurrent(sdk, c, k)
                if args.only != "threads":
                    contenders["SDK tasks"] = lambda c, k: concurrent_tasks(loop, sdk_async, c, k)
                for clients in levels:
                    per_client = max(2, args.requests // clients)
                    rates: dict[str, list[float]] = {label: [] for label in contenders}
                    cpu: dict[str, list[float]] = {label: [] for label in contenders}
                    for run in contenders.values():
                        run(clients, 1)  # connections
                    for r in range(args.rounds):
                        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
                        for label in order:
                            start = time.process_time()
                            wall, seconds, moved = contenders[label](clients, per_client)
                            cpu[label].append((time.process_time() - start) / len(seconds))
                            rates[label].append(moved / wall / 1e6)
                    med = {label: statistics.median(v) for label, v in rates.items()}
                    ms = {label: statistics.median(v) * 1e3 for label, v in cpu.items()}
                    line = (
                        f"{size} MB, {clients:2d} clients: urllib3 {med['urllib3']:.0f} MB/s "
                        f"[{ms['urllib3']:.2f} ms CPU/GET]"
                    )
                    for label in contenders:
                        if label != "urllib3":
                            line += (
                                f", {label} {med[label]:.0f} MB/s "
                                f"({med[label] / med['urllib3']:.2f}x) [{ms[label]:.2f} ms]"
                            )
                    print(line, flush=True)
        finally:
            client.close()
            loop.run(aclient.aclose())
            loop.close()
            pool.clear()
            srv.stop()
    print(f"load average at end: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
