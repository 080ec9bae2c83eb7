"""Load: 64 concurrent SDK clients mix PUT/GET/HEAD/batch-exists against a real server
with its S3 tier and a disk tier small enough to evict all the time.

Every body read back is compared with what was written, every acknowledged write must
stay readable, and no request may end in a 5xx. CI runs 15 s; the figures in the README
come from ``EC_LOAD_SECONDS=60``. ``EC_LOAD_REPORT=path.json`` keeps the summary.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import ec_cache
import httpx
import torch

from bench.stats import percentile
from tests.s3.conftest import ServerFactory

SECONDS = float(os.environ.get("EC_LOAD_SECONDS", "15"))
CLIENTS = int(os.environ.get("EC_LOAD_CLIENTS", "64"))
KEYS = 240
MODEL = "load/test-encoder@rev1"
# PUT 25%, GET 45%, HEAD 15%, batch exists 15%
OPERATIONS = ["put"] * 25 + ["get"] * 45 + ["head"] * 15 + ["exists_many"] * 15


def expected(index: int) -> torch.Tensor:
    """The one tensor key ``index`` may ever hold (8 KB to 1 MB of bfloat16)."""
    generator = torch.Generator().manual_seed(index)
    rows = 16 + (index * 7919) % 2032
    return torch.randn(rows, 256, generator=generator).to(torch.bfloat16)


@dataclass
class Tally:
    latencies: dict[str, list[float]] = field(
        default_factory=lambda: {op: [] for op in set(OPERATIONS)}
    )
    acknowledged: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    bytes_verified: int = 0


async def one_client(url: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with ec_cache.AsyncClient(
        url,
        model=MODEL,
        dtype="bfloat16",
        retries=1,
        raise_on_unavailable=True,
        limits=ec_cache.Limits(buffer_pool_bytes=4 << 20),
    ) as cache:
        while time.monotonic() < deadline:
            op = rng.choice(OPERATIONS)
            index = rng.randrange(KEYS)
            start = time.perf_counter()
            try:
                if op == "put":
                    await cache.put(f"k{index}", expected(index))
                    tally.acknowledged.add(index)
                elif op == "get":
                    was_acknowledged = index in tally.acknowledged
                    got = await cache.get(f"k{index}")
                    if got is None and was_acknowledged:
                        tally.errors.append(f"k{index}: acknowledged but missing")
                    elif got is not None:
                        if not torch.equal(got, expected(index)):
                            tally.errors.append(f"k{index}: wrong bytes")
                        tally.bytes_verified += got.numel() * 2
                elif op == "head":
                    await cache.exists(f"k{index}")
                else:
                    await cache.exists_many([f"k{rng.randrange(KEYS)}" for _ in range(50)])
            except ec_cache.ECCacheError as exc:
                tally.errors.append(f"{op} k{index}: {type(exc).__name__}: {exc}")
            tally.latencies[op].append(time.perf_counter() - start)


async def run_load(url: str) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + SECONDS
    await asyncio.gather(*(one_client(url, seed, deadline, tally) for seed in range(CLIENTS)))
    return tally


async def read_back_all(url: str, acknowledged: set[int]) -> list[str]:
    problems = []
    async with ec_cache.AsyncClient(
        url, model=MODEL, dtype="bfloat16", raise_on_unavailable=True
    ) as cache:
        for index in sorted(acknowledged):
            got = await cache.get(f"k{index}")
            if got is None or not torch.equal(got, expected(index)):
                problems.append(f"k{index}")
    return problems


def test_mixed_load_with_s3_loses_nothing(make_server: ServerFactory) -> None:
    server = make_server("load", disk_max_bytes="24MiB", log_level="warning")
    started = time.monotonic()
    tally = asyncio.run(run_load(server.url))
    elapsed = time.monotonic() - started
    missing = asyncio.run(read_back_all(server.url, tally.acknowledged))

    metrics = httpx.get(f"{server.url}/metrics").text
    server_5xx = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("ec_http_requests_total") and 'status="5' in line
    )
    stats = httpx.get(f"{server.url}/stats").json()
    all_latencies = [s for values in tally.latencies.values() for s in values]
    summary = {
        "clients": CLIENTS,
        "seconds": round(elapsed, 1),
        "requests": len(all_latencies),
        "requests_per_s": round(len(all_latencies) / elapsed, 1),
        "p50_ms": round(percentile(all_latencies, 50) * 1e3, 2),
        "p99_ms": round(percentile(all_latencies, 99) * 1e3, 2),
        "p99_ms_by_op": {
            op: round(percentile(v, 99) * 1e3, 2) for op, v in tally.latencies.items() if v
        },
        "requests_by_op": {op: len(v) for op, v in tally.latencies.items()},
        "bytes_verified": tally.bytes_verified,
        "acknowledged_writes": len(tally.acknowledged),
        "lost_writes": len(missing),
        "errors": len(tally.errors),
        "server_5xx": server_5xx,
        "disk_evictions": stats["disk"]["evictions"],
        "lookups": stats["lookups"],
    }
    print("load summary:", json.dumps(summary))
    if report := os.environ.get("EC_LOAD_REPORT"):
        with open(report, "w") as f:
            json.dump(summary, f, indent=1)
    assert tally.errors == []
    assert missing == []
    assert server_5xx == 0
    assert len(all_latencies) > CLIENTS  # every client got work done
    assert stats["disk"]["evictions"] > 0  # the S3 tier really served re-reads
    assert stats["lookups"]["s3"] > 0
