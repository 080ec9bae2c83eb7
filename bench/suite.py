"""The whole benchmark: sections, each returning plain JSON-able results."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import ec_cache
import torch
import urllib3

from app.checksum import crc32c
from app.keys import EntryKey
from bench import provenance, put_scale
from bench.contenders import (
    Endpoints,
    Item,
    boto3_client,
    get_contenders,
    put_contenders,
    remove_quietly,
    same_bits,
    write_local_file,
    write_nginx_file,
)
from bench.payloads import (
    DTYPE,
    FULL_PAYLOADS,
    MIX_CLASSES,
    MODEL,
    QUICK_PAYLOADS,
    Payload,
    mixed_workload,
)
from bench.provenance import load_average
from bench.runner import Contender, EventLoopThread, concurrent, concurrent_tasks, interleaved
from bench.services import (
    MemorySampler,
    Services,
    http_json,
    proc_memory,
    time_to_healthz,
)
from bench.stats import median, percentile, target_row
from testkit.server import ServerProcess

MiB = 1024 * 1024
S3_PREFIX = "ec"
SCALE_SDK_THREADS = "ec-cache SDK, threads"
SCALE_SDK_TASKS = "ec-cache AsyncClient, asyncio tasks"
SCALE_URLLIB3 = "ec-cache urllib3, threads"


@dataclass
class Plan:
    """How much of everything to run (full or quick)."""

    quick: bool
    payloads: list[Payload]
    #: payload name -> (requests per round, rounds); PUT uses the same
    requests: dict[str, tuple[int, int]]
    mixed: list[Payload]
    mixed_rounds: int
    mixed_scale: float = 1.0
    s3_keys_per_payload: int = 3
    head_requests: int = 200
    head_per_client_64: int = 10
    exists_sizes: tuple[int, ...] = (1, 100, 1000)
    exists_reps: int = 50
    absent_exists: int = 100
    absent_reps: int = 5
    #: 4.7 MB and 19.3 MB; 67 MB x 64 clients would hold 4.3 GB of results at once
    scale_payloads: list[Payload] = field(default_factory=lambda: FULL_PAYLOADS[1:3])
    scale_clients: tuple[int, ...] = (1, 4, 16, 64)
    scale_rounds: int = 3
    scale_requests: int = 64  # per level and contender, at least 2 per client
    rss_payload: Payload = FULL_PAYLOADS[3]
    rss_entries: int = 4
    rss_clients: int = 64
    rss_gets_per_client: int = 2
    rebuild_sizes: tuple[int, ...] = (100, 10_000, 100_000)
    rebuild_puts: int = 100
    fill_payload: Payload = field(default_factory=lambda: Payload("fill-128x4096", (128, 4096)))
    fill_capacity: int = 32
    fill_puts: int = 96
    small_requests: int = 200  # per round and contender
    small_rounds: int = 7

    @classmethod
    def full(cls) -> Plan:
        return cls(
            quick=False,
            payloads=FULL_PAYLOADS,
            requests={
                "small-64x1024": (50, 5),
                "llava-576x4096": (20, 5),
                "qwen25vl-2691x3584": (8, 5),
                "qwen3vl-2040x16384": (4, 5),
            },
            mixed=mixed_workload(20),
            mixed_rounds=3,
        )

    @classmethod
    def quick_plan(cls) -> Plan:
        return cls(
            quick=True,
            payloads=QUICK_PAYLOADS,
            requests={p.name: (4, 2) for p in QUICK_PAYLOADS},
            mixed=mixed_workload(20, scale=0.01),
            mixed_rounds=1,
            mixed_scale=0.01,
            head_requests=20,
            head_per_client_64=2,
            exists_reps=3,
            absent_exists=10,
            absent_reps=1,
            scale_payloads=QUICK_PAYLOADS[1:2],
            scale_rounds=1,
            scale_requests=8,
            rss_payload=QUICK_PAYLOADS[1],
            rss_gets_per_client=1,
            rebuild_sizes=(100, 1000),
            rebuild_puts=10,
            fill_payload=Payload("fill-16x1024", (16, 1024)),
            fill_capacity=8,
            fill_puts=24,
            small_requests=20,
            small_rounds=2,
        )


def machine() -> dict[str, Any]:
    import safetensors

    return provenance.machine(
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        boto3=boto3.__version__,
        urllib3=str(getattr(urllib3, "__version__", "?")),
        safetensors=safetensors.__version__,
        ec_cache_sdk=ec_cache.__version__,
    )


def _client(url: str, **limits: int) -> ec_cache.Client:
    return ec_cache.Client(
        url, model=MODEL, dtype=DTYPE, limits=ec_cache.Limits(**limits) if limits else None
    )


# --------------------------------------------------------------------------- transfers


def transfers(svc: Services, plan: Plan, log: Any) -> dict[str, Any]:
    """GET (and PUT) of every payload and of the mixed workload."""
    s3 = svc.s3()
    nginx = svc.nginx()
    hot_srv = svc.server("hot", s3_prefix=S3_PREFIX, disk_max_bytes="20GiB", max_body_bytes="1GiB")
    wb_srv = svc.server(
        "writeback",
        s3_prefix=S3_PREFIX,
        disk_max_bytes="20GiB",
        max_body_bytes="1GiB",
        write_mode="write-back",
    )
    disk_srv = svc.server("diskonly", disk_max_bytes="20GiB", max_body_bytes="1GiB")
    local_dir = svc.root / "local"
    local_dir.mkdir()
    ep = Endpoints(
        nginx_port=nginx.port,
        nginx_www=nginx.www,
        hot=_client(hot_srv.url),
        hot_url=hot_srv.url,
        writeback=_client(wb_srv.url),
        writeback_url=wb_srv.url,
        disk_only=_client(disk_srv.url),
        s3=boto3_client(s3.endpoint_url, s3.access_key, s3.secret_key),
        bucket=s3.bucket,
        prefix=S3_PREFIX,
        local_dir=local_dir,
    )
    out: dict[str, Any] = {
        "servers": {
            "hot": "write-through, S3 (SeaweedFS), disk 20 GiB: disk hits",
            "writeback": "write-back, S3, disk 20 GiB",
            "diskonly": "no S3, disk 20 GiB (PUT diagnostic)",
            "cold": "write-through, S3; disk bound = largest entry, keys read in a "
            "strict cycle larger than the disk, so every GET misses the disk (LRU)",
        },
        "workloads": {},
    }
    workloads: list[tuple[str, list[Item], int, int, Payload | None]] = []
    for index, fixed in enumerate(plan.payloads):
        requests, rounds = plan.requests[fixed.name]
        tensor = fixed.tensor(seed=index)
        items = [Item(f"{fixed.name}-{k}", fixed, tensor) for k in range(plan.s3_keys_per_payload)]
        workloads.append((fixed.name, items, requests, rounds, fixed))
    mixed_items = [Item(p.name, p, p.tensor(seed=100 + i)) for i, p in enumerate(plan.mixed)]
    workloads.append(("mixed", mixed_items, len(mixed_items), plan.mixed_rounds, None))

    for name, items, requests, rounds, payload in workloads:
        log(f"transfers: {name} ({len(items)} keys, {requests} requests x {rounds} rounds)")
        started = time.monotonic()
        entry: dict[str, Any] = {"loadavg_before": load_average()}
        sizes = sorted(item.payload.size for item in items)
        entry["entry_bytes"] = {
            "min": sizes[0],
            "median": median(sizes),
            "max": sizes[-1],
            "keys": len(items),
        }
        if payload is not None:
            entry["shape"] = list(payload.shape)
            entry["note"] = payload.note
        else:
            entry["note"] = (
                "mixed: "
                + ", ".join(
                    f"{share:.0%} {low / 1e6:g}-{high / 1e6:g} MB"
                    for share, low, high in MIX_CLASSES
                )
                + (f", sizes x{plan.mixed_scale:g}" if plan.mixed_scale != 1 else "")
                + f"; {len(items)} distinct entries, each round reads each once"
            )
        setup_start = time.monotonic()
        for item in items:
            write_nginx_file(ep.nginx_www, item)
            write_local_file(ep.local_dir, item)
        ep.hot.put_many([(item.key, item.tensor) for item in items])
        entry["setup_s"] = round(time.monotonic() - setup_start, 2)
        cold_srv = svc.server(
            f"cold-{name}",
            s3_prefix=S3_PREFIX,
            disk_max_bytes=sizes[-1],
            max_body_bytes="1GiB",
        )
        assert sum(sizes) - sizes[-1] > sizes[-1], "the cycle must exceed the cold disk"
        cold = _client(cold_srv.url)
        contenders, close = get_contenders(ep, items, cold, cold_srv.data_dir)
        try:
            entry["get"] = interleaved(contenders, rounds=rounds, requests=requests, warmup=2)
        finally:
            close()
        entry["cold_server_lookups"] = http_json(cold_srv.url + "/stats")["lookups"]
        cold.close()
        svc.stop_server(cold_srv)
        if payload is not None:
            log(f"transfers: {name} PUT")
            put, close = put_contenders(ep, payload, items[0].tensor)
            try:
                entry["put"] = interleaved(put, rounds=rounds, requests=requests, warmup=1)
            finally:
                close()
        # Free the disk space of this workload before the next one.
        for item in items:
            ep.hot.delete(item.key)
            remove_quietly(ep.nginx_www / item.file_name)
            remove_quietly(ep.local_dir / item.key)
        entry["loadavg_after"] = load_average()
        entry["duration_s"] = round(time.monotonic() - started, 1)
        out["workloads"][name] = entry
    ep.hot.close()
    ep.writeback.close()
    ep.disk_only.close()
    svc.stop_server(disk_srv)
    svc.stop_server(wb_srv)
    svc.stop_server(hot_srv)
    return out


# --------------------------------------------------------------------------- lookups


def lookups(svc: Services, plan: Plan, log: Any) -> dict[str, Any]:
    """The scheduler's question: HEAD at 1 and 64 clients, batch existence."""
    nginx = svc.nginx()
    srv = svc.server("lookups", s3_prefix="ec-lookups", disk_max_bytes="1GiB")
    client = _client(srv.url, max_keepalive=64, concurrency=16)
    tiny = torch.zeros(1, 8, dtype=torch.bfloat16)
    count = max(plan.exists_sizes)
    started = time.monotonic()
    client.put_many([(f"exists-{i}", tiny) for i in range(count)])
    setup_s = time.monotonic() - started
    (nginx.www / "head.bin").write_bytes(b"x" * 1024)
    local_dir = svc.root / "local-exists"
    (local_dir / "exists-0").mkdir(parents=True)
    (local_dir / "exists-0" / "encoder_cache.safetensors").write_bytes(b"x")
    pool = urllib3.HTTPConnectionPool("127.0.0.1", nginx.port, maxsize=64, block=True)
    out: dict[str, Any] = {
        "loadavg_before": load_average(),
        "setup_s": round(setup_s, 2),
        "server": "S3-configured (write-through); present entries answer from the disk index",
    }

    def head_sdk(_: int, i: int) -> int:
        if client.head(f"exists-{i % count}") is None:
            raise RuntimeError("HEAD missed")
        return 0

    def head_nginx(_: int, i: int) -> int:
        if pool.request("HEAD", "/head.bin").status != 200:
            raise RuntimeError("nginx HEAD failed")
        return 0

    def local_exists(_: int, i: int) -> int:
        if not os.path.exists(local_dir / "exists-0" / "encoder_cache.safetensors"):
            raise RuntimeError("missing")
        return 0

    rows: dict[str, Any] = {}
    for clients, per_client in ((1, plan.head_requests), (64, plan.head_per_client_64)):
        for label, op in (
            ("ec-cache SDK head", head_sdk),
            ("nginx HEAD (urllib3)", head_nginx),
            ("os.path.exists (node-local)", local_exists),
        ):
            if clients > 1 and label.startswith("os.path"):
                continue
            op(0, 0)
            wall, seconds, _ = concurrent(op, clients, per_client)
            rows[f"{label} x{clients}"] = {
                "what": label,
                "clients": clients,
                "requests": len(seconds),
                "p50_ms": median(seconds) * 1e3,
                "p99_ms": percentile(seconds, 99) * 1e3,
                "per_s": len(seconds) / wall,
            }
    log("lookups: exists_many")
    batches = {n: [f"exists-{i}" for i in range(n)] for n in plan.exists_sizes}
    raw: dict[int, list[float]] = {n: [] for n in (0, *plan.exists_sizes)}
    for hashes in batches.values():
        assert all(client.exists_many(hashes))
    for rep in range(plan.exists_reps):
        order = [0, *plan.exists_sizes]
        if rep % 2:
            order.reverse()
        for n in order:
            start = time.perf_counter()
            if n:
                client.exists_many(batches[n])
            else:
                client.head("exists-0")
            raw[n].append(time.perf_counter() - start)
    head = raw.pop(0)
    rows["ec-cache SDK head, interleaved"] = {
        "what": "ec-cache SDK head (interleaved with exists_many)",
        "clients": 1,
        "requests": len(head),
        "p50_ms": median(head) * 1e3,
        "p99_ms": percentile(head, 99) * 1e3,
        "per_s": len(head) / sum(head),
    }
    for n, seconds in raw.items():
        rows[f"exists_many {n} present"] = {
            "what": f"exists_many({n}), all present",
            "clients": 1,
            "requests": len(seconds),
            "p50_ms": median(seconds) * 1e3,
            "p99_ms": percentile(seconds, 99) * 1e3,
            "per_s": len(seconds) / sum(seconds),
        }
    absent = [f"absent-{i}" for i in range(plan.absent_exists)]
    seconds = []
    for _ in range(plan.absent_reps):
        start = time.perf_counter()
        assert not any(client.exists_many(absent))
        seconds.append(time.perf_counter() - start)
    rows[f"exists_many {plan.absent_exists} absent"] = {
        "what": f"exists_many({plan.absent_exists}), all absent: one S3 HEAD each",
        "clients": 1,
        "requests": len(seconds),
        "p50_ms": median(seconds) * 1e3,
        "p99_ms": percentile(seconds, 99) * 1e3,
        "per_s": len(seconds) / sum(seconds),
    }
    out["rows"] = rows
    out["loadavg_after"] = load_average()
    client.close()
    pool.close()
    svc.stop_server(srv)
    shutil.rmtree(local_dir, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- floor

FLOOR_GET = "ASGI floor GET (urllib3)"
FLOOR_HEAD = "ASGI floor HEAD (urllib3)"
EC_GET = "ec-cache GET (urllib3)"
EC_HEAD = "ec-cache HEAD (urllib3)"
EC_SDK_GET = "ec-cache SDK get"
NGINX_GET = "nginx GET (urllib3)"


def floor(svc: Services, plan: Plan, log: Any) -> dict[str, Any]:
    """Small requests against the framework floor: the 128 KiB disk-hit GET and the
    HEAD of ec-cache (disk only, default settings) next to ``bench.asgi_floor`` (a raw
    ASGI app on the same uvicorn options serving the same bytes) and nginx, each on one
    keep-alive connection, interleaved rounds."""
    payload = plan.payloads[0]
    tensor = payload.tensor(0)
    body = payload.body(tensor)
    nginx = svc.nginx()
    (nginx.www / "small.bin").write_bytes(body)
    srv = svc.server("floor")
    key = f"{payload.name}-floor"
    with _client(srv.url) as client:
        client.put(key, tensor)
    floor_srv = svc.asgi_floor("small", nginx.www / "small.bin")
    path = f"/ec/{MODEL}/{DTYPE}/{key}"
    pools = {
        name: urllib3.HTTPConnectionPool("127.0.0.1", port, maxsize=1)
        for name, port in (("floor", floor_srv.port), ("ec", srv.port), ("nginx", nginx.port))
    }
    sdk = _client(srv.url)

    def request(pool: str, method: str, target: str) -> Callable[[int], int]:
        def op(_: int) -> int:
            response = pools[pool].request(method, target)
            if response.status != 200 or (method == "GET" and response.data != body):
                raise RuntimeError(f"{pool} {method} answered {response.status}")
            return len(response.data)

        return op

    def sdk_get(_: int) -> int:
        got = sdk.get(key)
        if got is None or not same_bits(got, tensor):
            raise RuntimeError("SDK read other bits (or missed)")
        return len(body)

    contenders = [
        Contender(FLOOR_GET, "ceiling", request("floor", "GET", path)),
        Contender(EC_GET, "ec-cache", request("ec", "GET", path)),
        Contender(EC_SDK_GET, "ec-cache", sdk_get),
        Contender(NGINX_GET, "ceiling", request("nginx", "GET", "/small.bin")),
        Contender(FLOOR_HEAD, "ceiling", request("floor", "HEAD", path)),
        Contender(EC_HEAD, "ec-cache", request("ec", "HEAD", path)),
    ]
    out: dict[str, Any] = {
        "loadavg_before": load_average(),
        "entry_bytes": len(body),
        "contenders": interleaved(
            contenders, rounds=plan.small_rounds, requests=plan.small_requests, warmup=20
        ),
        "loadavg_after": load_average(),
    }
    sdk.close()
    for pool in pools.values():
        pool.close()
    svc.stop_server(floor_srv)
    svc.stop_server(srv)
    return out


# --------------------------------------------------------------------------- scale


def scale(svc: Services, plan: Plan, log: Any) -> dict[str, Any]:
    """Throughput and p99 of disk-hit GETs at 1..64 concurrent clients, per payload:
    the SDK from threads (one shared ``Client``) and from asyncio tasks (one shared
    ``AsyncClient``) against urllib3 (one pool) on the same ec-cache server, with
    nginx+urllib3 as the ceiling."""
    nginx = svc.nginx()
    srv = svc.server("scale", disk_max_bytes="4GiB")
    most = max(plan.scale_clients)
    client = _client(srv.url, max_keepalive=most, concurrency=most)
    loop = EventLoopThread()
    aclient = ec_cache.AsyncClient(
        srv.url, model=MODEL, dtype=DTYPE, limits=ec_cache.Limits(max_keepalive=most)
    )
    pool = urllib3.HTTPConnectionPool("127.0.0.1", nginx.port, maxsize=most, block=True)
    ec_pool = urllib3.HTTPConnectionPool("127.0.0.1", srv.port, maxsize=most, block=True)
    payloads: dict[str, Any] = {}
    try:
        for payload in plan.scale_payloads:
            key = f"scale-{payload.name}"
            tensor = payload.tensor(seed=42)
            client.put(key, tensor)
            (nginx.www / f"{key}.safetensors").write_bytes(payload.body(tensor))
            got = loop.run(aclient.get(key))
            if got is None or not same_bits(got, tensor):
                raise RuntimeError("AsyncClient read back other bits")
            payloads[payload.name] = {
                "entry_bytes": payload.size,
                "levels": _scale_levels(
                    plan, log, payload, key, client, aclient, loop, pool, ec_pool
                ),
            }
            client.delete(key)
            remove_quietly(nginx.www / f"{key}.safetensors")
    finally:
        client.close()
        loop.run(aclient.aclose())
        loop.close()
        pool.close()
        ec_pool.close()
        svc.stop_server(srv)
    return {
        "clients_are": (
            "threads of one process sharing one SDK Client / urllib3 pool, or asyncio "
            "tasks on one event loop sharing one AsyncClient"
        ),
        "payloads": payloads,
        "loadavg_after": load_average(),
    }


def _scale_levels(
    plan: Plan,
    log: Any,
    payload: Payload,
    key: str,
    client: ec_cache.Client,
    aclient: ec_cache.AsyncClient,
    loop: EventLoopThread,
    pool: urllib3.HTTPConnectionPool,
    ec_pool: urllib3.HTTPConnectionPool,
) -> dict[str, Any]:
    path = f"/ec/{MODEL}/{DTYPE}/{key}"

    def sdk(_: int, __: int) -> int:
        if client.get(key) is None:
            raise RuntimeError("miss")
        return payload.size

    async def sdk_async(_: int, __: int) -> int:
        if await aclient.get(key) is None:
            raise RuntimeError("miss")
        return payload.size

    def ngx(_: int, __: int) -> int:
        return len(pool.request("GET", f"/{key}.safetensors").data)

    def ec_urllib3(_: int, __: int) -> int:
        return len(ec_pool.request("GET", path).data)

    Run = Callable[[int, int], tuple[float, list[float], int]]
    contenders: dict[str, Run] = {
        "nginx+urllib3": lambda n, k: concurrent(ngx, n, k),
        SCALE_SDK_THREADS: lambda n, k: concurrent(sdk, n, k),
        SCALE_SDK_TASKS: lambda n, k: concurrent_tasks(loop, sdk_async, n, k),
        SCALE_URLLIB3: lambda n, k: concurrent(ec_urllib3, n, k),
    }
    levels: dict[str, Any] = {}
    for clients in plan.scale_clients:
        per_client = max(2, plan.scale_requests // clients)
        raw: dict[str, list[tuple[float, list[float], int]]] = {k: [] for k in contenders}
        for run in contenders.values():
            run(clients, 1)  # open the connections
        for round_index in range(plan.scale_rounds):
            order = list(contenders) if round_index % 2 == 0 else list(reversed(contenders))
            for label in order:
                raw[label].append(contenders[label](clients, per_client))
        level: dict[str, Any] = {}
        for label, runs in raw.items():
            flat = [s for _, seconds, _ in runs for s in seconds]
            level[label] = {
                "mb_per_s_median": median([moved / wall / 1e6 for wall, _, moved in runs]),
                "p50_ms": median(flat) * 1e3,
                "p99_ms": percentile(flat, 99) * 1e3,
                "requests": len(flat),
            }
        levels[str(clients)] = level
        log(f"scale: {payload.name}, {clients} clients done")
    return levels


# --------------------------------------------------------------------------- memory


def _prebuild(data_dir: Path, entries: list[tuple[EntryKey, bytes]]) -> int:
    """Write committed entries straight into the disk tier's layout; returns bytes."""
    total = 0
    crcs: dict[int, str] = {}
    for key, body in entries:
        crc = crcs.setdefault(id(body), f"{crc32c(body):08x}")
        shard = data_dir / "objects" / key.digest[:2]
        shard.mkdir(parents=True, exist_ok=True)
        fd = os.open(shard / f"{key.digest}.{crc}.safetensors", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        total += len(body)
    os.sync()  # or the server's first fsyncs pay for writing back all of these
    return total


def _drain_get(port: int, path: str, scratch: memoryview) -> int:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        total = 0
        while True:
            n = sock.recv_into(scratch)
            if n == 0:
                return total
            total += n


def memory(svc: Services, plan: Plan, log: Any) -> dict[str, Any]:
    """Server RSS while 64 clients GET large entries at once (fresh process)."""
    payload = plan.rss_payload
    tensor = payload.tensor(seed=5)
    body = payload.body(tensor)
    keys = [EntryKey(MODEL, DTYPE, f"rss-{i}") for i in range(plan.rss_entries)]
    data_dir = svc.root / "ec-rss"
    shutil.rmtree(data_dir, ignore_errors=True)
    _prebuild(data_dir, [(key, body) for key in keys])
    del body
    srv = ServerProcess(data_dir, svc.root / "ec-rss.log", disk_max_bytes="8GiB")
    srv.start()
    try:
        assert srv.proc is not None
        pid = srv.proc.pid
        at_start = proc_memory(pid)
        scratch = [memoryview(bytearray(MiB)) for _ in range(plan.rss_clients)]
        for key in keys:  # first GET verifies the CRC32C once
            assert _drain_get(srv.port, f"/ec/{key}", scratch[0]) > payload.size
        warmed = proc_memory(pid)

        def op(client: int, _: int) -> int:
            got = _drain_get(srv.port, f"/ec/{keys[client % len(keys)]}", scratch[client])
            if got < payload.size:
                raise RuntimeError(f"short body: {got}")
            return payload.size

        sampler = MemorySampler(pid)
        with sampler.running():
            wall, seconds, moved = concurrent(op, plan.rss_clients, plan.rss_gets_per_client)
        after = proc_memory(pid)
    finally:
        srv.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    log("memory: done")
    return {
        "payload": payload.name,
        "entry_bytes": payload.size,
        "distinct_entries": len(keys),
        "clients": plan.rss_clients,
        "gets_per_client": plan.rss_gets_per_client,
        "client": "raw sockets draining into 1 MiB scratch buffers (threads)",
        "naive_bytes": plan.rss_clients * payload.size,
        "at_start": at_start,
        "after_warmup": warmed,
        "peak_during": sampler.peak,
        "samples": sampler.samples,
        "after": after,
        "mb_per_s": moved / wall / 1e6,
        "p99_ms": percentile(seconds, 99) * 1e3,
        "loadavg_after": load_average(),
    }


# --------------------------------------------------------------------------- start-up


def startup(svc: Services, plan: Plan, log: Any) -> dict[str, Any]:
    """Index rebuild: time to /healthz with N entries, then PUTs that each evict one."""
    small = Payload("rebuild-1x64", (1, 64))
    body = small.body(small.tensor(seed=9))
    tensor = small.tensor(seed=10)
    rows: dict[str, Any] = {}
    for count in plan.rebuild_sizes:
        data_dir = svc.root / "ec-rebuild"
        shutil.rmtree(data_dir, ignore_errors=True)
        started = time.monotonic()
        total = _prebuild(data_dir, [(EntryKey(MODEL, DTYPE, f"r{i}"), body) for i in range(count)])
        created_s = time.monotonic() - started
        srv = ServerProcess(data_dir, svc.root / "ec-rebuild.log", disk_max_bytes=total)
        try:
            healthz_s = time_to_healthz(srv)
            stats = http_json(srv.url + "/stats")["disk"]
            assert stats["entries"] == count, stats
            client = _client(srv.url)
            seconds = []
            for i in range(plan.rebuild_puts):
                start = time.perf_counter()
                client.put(f"new-{i}", tensor)
                seconds.append(time.perf_counter() - start)
            evictions = http_json(srv.url + "/stats")["disk"]["evictions"]
            client.close()
        finally:
            srv.stop()
            shutil.rmtree(data_dir, ignore_errors=True)
        rows[str(count)] = {
            "entries": count,
            "create_files_s": round(created_s, 2),
            "time_to_healthz_s": healthz_s,
            "put_evicting_p50_ms": median(seconds) * 1e3,
            "put_evicting_p99_ms": percentile(seconds, 99) * 1e3,
            "puts": len(seconds),
            "evictions": evictions,
        }
        log(f"startup: {count} entries: {healthz_s:.2f}s to /healthz")
    return {
        "entry_bytes": small.size,
        "how": "files written straight into {data_dir}/objects/<xx>/<digest>.<crc>.safetensors; "
        "disk bound = exactly their total, so every PUT afterwards evicts one",
        "rows": rows,
        "loadavg_after": load_average(),
    }


def eviction(svc: Services, plan: Plan, log: Any) -> dict[str, Any]:
    """PUT latency as a disk tier fills up and then evicts on every PUT."""
    payload = plan.fill_payload
    tensor = payload.tensor(seed=11)
    srv = svc.server("fill", disk_max_bytes=plan.fill_capacity * payload.size)
    client = _client(srv.url)
    seconds = []
    used = []
    for i in range(plan.fill_puts):
        start = time.perf_counter()
        client.put(f"fill-{i}", tensor)
        seconds.append(time.perf_counter() - start)
        used.append(min(i + 1, plan.fill_capacity))
    stats = http_json(srv.url + "/stats")["disk"]
    client.close()
    svc.stop_server(srv)
    filling, evicting = seconds[: plan.fill_capacity], seconds[plan.fill_capacity :]
    log("eviction: done")
    return {
        "entry_bytes": payload.size,
        "capacity_entries": plan.fill_capacity,
        "puts": plan.fill_puts,
        "filling_p50_ms": median(filling) * 1e3,
        "evicting_p50_ms": median(evicting) * 1e3,
        "evicting_p99_ms": percentile(evicting, 99) * 1e3,
        "evictions": stats["evictions"],
        "raw_seconds": [round(s, 6) for s in seconds],
        "loadavg_after": load_average(),
    }


# --------------------------------------------------------------------------- targets


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = put_scale.targets(results)
    workloads = results.get("transfers", {}).get("workloads", {})
    for name, entry in workloads.items():
        get = entry["get"]
        big = name == "mixed" or entry["entry_bytes"]["max"] >= 4_700_000
        if big:
            rows.append(
                target_row(
                    f"disk-hit GET via SDK vs nginx+urllib3, {name}",
                    1.0,
                    get["ec-cache SDK, disk hit"]["mb_per_s_median"],
                    get["nginx+urllib3"]["mb_per_s_median"],
                )
            )
        rows.append(
            target_row(
                f"S3-hit GET via SDK vs boto3 get_object, {name}",
                0.9,
                get["ec-cache SDK, S3 hit"]["mb_per_s_median"],
                get["boto3 get_object"]["mb_per_s_median"],
            )
        )
        if "put" in entry:
            put = entry["put"]
            rows.append(
                target_row(
                    f"PUT write-back via SDK vs nginx DAV PUT, {name}",
                    0.9,
                    put["ec-cache SDK PUT, write-back"]["mb_per_s_median"],
                    put["nginx DAV PUT"]["mb_per_s_median"],
                )
            )
    for name, entry in results.get("scale", {}).get("payloads", {}).items():
        if entry["entry_bytes"] < 4_700_000:
            continue
        for clients, level in entry["levels"].items():
            for label in (SCALE_SDK_THREADS, SCALE_SDK_TASKS):
                rows.append(
                    target_row(
                        f"{label} vs urllib3, same server, {clients} clients, {name}",
                        1.0,
                        level[label]["mb_per_s_median"],
                        level[SCALE_URLLIB3]["mb_per_s_median"],
                    )
                )
    small = results.get("floor", {}).get("contenders", {})
    if small:
        for label, reference in ((EC_GET, FLOOR_GET), (EC_HEAD, FLOOR_HEAD)):
            rows.append(
                target_row(
                    f"{label} p50 vs {reference} p50, 128 KiB",
                    1.3,
                    small[label]["p50_ms"],
                    small[reference]["p50_ms"],
                    higher_is_better=False,
                )
            )
        rows.append(
            target_row(
                f"{EC_SDK_GET} vs {NGINX_GET}, 128 KiB",
                0.5,
                small[EC_SDK_GET]["mb_per_s_median"],
                small[NGINX_GET]["mb_per_s_median"],
            )
        )
    lookup_rows = results.get("lookups", {}).get("rows", {})
    batch = lookup_rows.get("exists_many 1000 present")
    head = lookup_rows.get("ec-cache SDK head, interleaved")
    if batch and head:
        rows.append(
            target_row(
                "exists_many(1000) p50 vs one HEAD p50 (interleaved)",
                5.0,
                batch["p50_ms"],
                head["p50_ms"],
                higher_is_better=False,
            )
        )
    return rows
