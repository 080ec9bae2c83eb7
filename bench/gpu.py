"""The SDK's GPU path, measured: GET into CUDA tensors and PUT from them off the compute
stream, against an ec-cache server (``python -m app``, disk tier) on loopback.

    python -m bench.gpu --out DIR            # on a CUDA machine (sized for < 8 min on an H200)
    python -m bench.gpu --cpu --quick        # the same logic on the CPU (CI, ~10 s)

Writes ``DIR/gpu.json`` (every raw number, the machine) and ``DIR/gpu.md`` (tables,
checks, targets) and prints the markdown. Sections:

GET, for 4.7, 19.3 and 67 MB bf16 entries (576x4096, 2691x3584, 2040x16384), disk hits,
interleaved rounds (the order of the methods rotates every round), CRC32C verified:
  a. ``Client.get(h, out=pinned)``: receive into a pinned host buffer alone
  b. a. plus a synchronous host-to-device copy
  c. ``Client.get(h, device="cuda:0")``, then a device synchronize (the copy is counted)
  c2. ``Client.get(h, out=cuda_tensor)`` (diagnostic)
  d. ``AsyncClient``: 8 concurrent GETs of 8 entries into CUDA, aggregate throughput
  Target: c >= 0.9x a (the device copy hidden behind the receive).

Checks (each passes or fails; none is timed):
  * the bytes on the device equal the stored ones (compared on the device, bitwise), for
    the sync and the async client, and a CPU GET equals them too;
  * results never alias pooled staging buffers: a result survives the next 100 GETs of
    other entries of the same size unchanged (sync, and async 8 at a time);
  * a result is safe on the caller's current stream with no extra synchronisation
    (GETs under a side stream while the default stream is kept busy);
  * ``device="cuda"`` lands on the current device.

Save path, 19.3 MB entries: a loop of bf16 8192x8192 matrix products on the default
stream, timed alone and while saves proceed: ``Client.put`` of CUDA tensors from a
thread (on its default current stream, and on a side stream), and the vLLM connector's
``save_caches`` called from the compute thread (with ``bench/vllm_shim.py`` standing in
for vLLM where it is not installed). Target: >= 0.95x the speed alone.

In ``--cpu`` mode the device is the CPU: "pinned" buffers are plain, copies are memcpy,
stream checks do not apply, and no target is judged (the numbers are not GPU figures).
``--quick`` uses small entries and few rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: testkit and bench from the checkout
    sys.path.insert(0, str(ROOT))

import ec_cache  # noqa: E402

from bench import vllm_shim  # noqa: E402
from testkit.server import ServerProcess  # noqa: E402

T = TypeVar("T")
MODEL = "bench/gpu"
DTYPE = torch.bfloat16
FULL_SHAPES = [(576, 4096), (2691, 3584), (2040, 16384)]  # 4.7, 19.3, 67 MB
QUICK_SHAPES = [(64, 1024), (256, 1024), (512, 2048)]
SAVE_SHAPE, QUICK_SAVE_SHAPE = (2691, 3584), (256, 1024)
KEYS_PER_SIZE = 8  # distinct entries per size: the 8 concurrent GETs, the alias check
ALIAS_GETS = 100
CONCURRENCY = 8
GET_TARGET, SAVE_TARGET = 0.9, 0.95
BUSY_CYCLES = 2_000_000_000  # torch.cuda._sleep: ~1 s at the H200's ~2 GHz

METHODS = {
    "a_recv_pinned": "a. receive into pinned host buffer",
    "b_recv_pinned_h2d": "b. a + synchronous H2D copy",
    "c_get_device": 'c. Client.get(device="cuda:0")',
    "c2_get_device_out": "c2. Client.get(out=device tensor)",
    "d_async8_device": "d. AsyncClient, 8 concurrent, into device",
}
SAVE_VARIANTS = {
    "put_thread": "Client.put(cuda tensor) from a thread",
    "put_thread_side_stream": "Client.put(cuda tensor) from a thread, on a side stream",
    "connector_save_caches": "connector save_caches from the compute thread",
}


@dataclass
class Params:
    shapes: list[tuple[int, int]]
    save_shape: tuple[int, int]
    rounds: int
    requests: int
    matmul_n: int
    compute_s: float  # target length of one timed matrix-product loop
    save_every_s: float  # connector: one save_caches per this much compute

    @classmethod
    def of(cls, *, quick: bool, cuda: bool) -> Params:
        return cls(
            shapes=QUICK_SHAPES if quick else FULL_SHAPES,
            save_shape=QUICK_SAVE_SHAPE if quick else SAVE_SHAPE,
            rounds=2 if quick else 5,
            requests=2 if quick else 8,
            matmul_n=8192 if cuda else 256,
            compute_s=(0.3 if quick else 1.0) if not cuda else (0.5 if quick else 2.0),
            save_every_s=0.02,
        )


class Backend:
    """The device under test: a CUDA device, or the CPU standing in for one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def host(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=DTYPE, pin_memory=self.cuda)

    def random(self, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return torch.randn(shape, generator=gen, device=self.device).to(DTYPE)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, computed where the tensors are (on the device for CUDA)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def label(shape: tuple[int, ...]) -> str:
    return f"{math.prod(shape) * DTYPE.itemsize / 1e6:.1f} MB"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Run:
    """Everything one run measured and checked; written as it goes."""

    out: Path
    backend: Backend
    params: Params
    quick: bool
    deadline: float
    started: float = field(default_factory=time.monotonic)
    results: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, name: str, ok: bool | None, detail: str = "") -> None:
        self.checks.append({"name": name, "pass": ok, "detail": detail})
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[ok]
        print(f"  [{mark}] {name}{': ' + detail if detail else ''}", flush=True)

    def write(self) -> None:
        self.results["checks"] = self.checks
        self.results["targets"] = targets(self)
        self.results["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu.json").write_text(json.dumps(self.results, indent=1) + "\n")
        (self.out / "gpu.md").write_text(markdown(self.results))


# -- set-up ------------------------------------------------------------------------------
def machine(backend: Backend) -> dict[str, Any]:
    info: dict[str, Any] = {
        "when_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(backend.device),
        "loadavg_start": list(os.getloadavg()),
    }
    if backend.cuda:
        props = torch.cuda.get_device_properties(backend.device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            device_count=torch.cuda.device_count(),
        )
    return info


@dataclass
class Entries:
    """Per size: the keys and their reference tensors (kept on the device)."""

    keys: dict[str, list[str]] = field(default_factory=dict)
    refs: dict[str, torch.Tensor] = field(default_factory=dict)
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)


def store_entries(run: Run, client: ec_cache.Client) -> Entries:
    """PUT ``KEYS_PER_SIZE`` random entries per size from device tensors."""
    entries = Entries()
    for si, shape in enumerate(run.params.shapes):
        name = label(shape)
        entries.shapes[name] = shape
        entries.keys[name] = []
        for k in range(KEYS_PER_SIZE):
            key = f"get-{shape[0]}x{shape[1]}-{k}"
            ref = run.backend.random(shape, seed=1000 * si + k)
            if not client.put(key, ref):
                raise RuntimeError(f"{key} was already stored: the data folder is not fresh")
            entries.keys[name].append(key)
            entries.refs[key] = ref
    run.backend.sync()
    return entries


async def gather(coros: Iterable[Awaitable[T]]) -> list[T]:
    return list(await asyncio.gather(*coros))


# -- GET throughput ----------------------------------------------------------------------
def get_section(
    run: Run,
    client: ec_cache.Client,
    aclient: ec_cache.AsyncClient,
    loop: asyncio.AbstractEventLoop,
    entries: Entries,
) -> None:
    backend, p = run.backend, run.params
    dev = backend.device
    section: dict[str, Any] = {"units": "MB/s (1e6 bytes/s) per round; ms per request"}
    run.results["get"] = section
    for name, shape in entries.shapes.items():
        keys = entries.keys[name]
        nbytes = math.prod(shape) * DTYPE.itemsize
        pinned = backend.host(shape)
        on_device = torch.empty(shape, dtype=DTYPE, device=dev)
        turn = [0]

        def next_key(keys: list[str] = keys, turn: list[int] = turn) -> str:
            turn[0] += 1
            return keys[turn[0] % len(keys)]

        def a(pinned: torch.Tensor = pinned) -> None:
            client.get(next_key(), out=pinned)

        def b(pinned: torch.Tensor = pinned, on_device: torch.Tensor = on_device) -> None:
            client.get(next_key(), out=pinned)
            on_device.copy_(pinned)  # non_blocking=False: returns once the copy is done
            backend.sync()

        def c() -> None:
            client.get(next_key(), device=dev)
            backend.sync()

        def c2(on_device: torch.Tensor = on_device) -> None:
            client.get(next_key(), out=on_device)
            backend.sync()

        def d(keys: list[str] = keys) -> None:
            loop.run_until_complete(gather(aclient.get(k, device=dev) for k in keys[:CONCURRENCY]))
            backend.sync()

        methods: dict[str, tuple[Callable[[], None], int]] = {
            "a_recv_pinned": (a, nbytes),
            "b_recv_pinned_h2d": (b, nbytes),
            "c_get_device": (c, nbytes),
            "c2_get_device_out": (c2, nbytes),
            "d_async8_device": (d, nbytes * CONCURRENCY),
        }
        rows: dict[str, dict[str, Any]] = {
            m: {"mb_per_s_rounds": [], "ms": [], "bytes_per_request": size}
            for m, (_, size) in methods.items()
        }
        for fn, _ in methods.values():  # warm-up: connections, pools, allocator, page cache
            for _ in range(2):
                fn()
        order = list(methods)
        for r in range(p.rounds):
            if r and run.left() < 0:  # at least one round, whatever the budget
                section["truncated"] = f"time budget: {r} of {p.rounds} rounds"
                break
            shift = r % len(order)
            rotated = order[shift:] + order[:shift]
            for m in rotated if r % 2 == 0 else rotated[::-1]:
                fn, size = methods[m]
                t0 = time.perf_counter()
                for _ in range(p.requests):
                    t1 = time.perf_counter()
                    fn()
                    rows[m]["ms"].append((time.perf_counter() - t1) * 1000)
                elapsed = time.perf_counter() - t0
                rows[m]["mb_per_s_rounds"].append(size * p.requests / elapsed / 1e6)
        for row in rows.values():
            row["mb_per_s_median"] = statistics.median(row["mb_per_s_rounds"])
            row["p50_ms"] = statistics.median(row["ms"])
            row["p99_ms"] = percentile(row["ms"], 0.99)
            row["requests"] = len(row["ms"])
        a_mbs = rows["a_recv_pinned"]["mb_per_s_median"]
        section[name] = {
            "shape": list(shape),
            "nbytes": nbytes,
            "methods": rows,
            "ratio_to_a": {m: row["mb_per_s_median"] / a_mbs for m, row in rows.items()},
        }
        print(
            f"  {name}: "
            + ", ".join(
                f"{m.split('_')[0]} {row['mb_per_s_median']:.0f}" for m, row in rows.items()
            )
            + " MB/s",
            flush=True,
        )
        run.write()


# -- correctness -------------------------------------------------------------------------
def check_bytes(
    run: Run,
    client: ec_cache.Client,
    aclient: ec_cache.AsyncClient,
    loop: asyncio.AbstractEventLoop,
    entries: Entries,
) -> None:
    dev = run.backend.device
    bad: list[str] = []
    for keys in entries.keys.values():
        for key in keys:
            ref = entries.refs[key]
            got = client.get(key, device=dev)
            if got is None or not same_bits(got, ref):
                bad.append(f"sync {key}")
            host = client.get(key)
            if host is None or not same_bits(host, ref.cpu()):
                bad.append(f"cpu {key}")
        results = loop.run_until_complete(aclient.get_many(keys, device=dev))
        bad += [
            f"async {k}"
            for k, t in zip(keys, results, strict=True)
            if t is None or not same_bits(t, entries.refs[k])
        ]
    n = sum(len(k) for k in entries.keys.values())
    run.check(
        "bytes on the device equal the stored ones (compared on the device)",
        not bad,
        f"{n} entries x (sync, async, CPU)" + (f"; mismatched: {bad}" if bad else ""),
    )


def check_no_alias(
    run: Run,
    client: ec_cache.Client,
    aclient: ec_cache.AsyncClient,
    loop: asyncio.AbstractEventLoop,
    entries: Entries,
) -> None:
    """A result must survive the next ``ALIAS_GETS`` GETs of other entries of the same
    size (same staging size class) unchanged; no device synchronisation in between."""
    backend = run.backend
    dev = backend.device
    bad: list[str] = []
    pool = getattr(client, "pool", None)  # the staging pool, where the client exposes it
    before = pool.stats() if pool is not None else None
    for name, keys in entries.keys.items():
        shape = entries.shapes[name]
        # On the CPU a result goes straight into a fresh tensor; a non-contiguous out=
        # goes through the staging pool, as every device GET does.
        out = None if backend.cuda else torch.empty(shape[::-1], dtype=DTYPE).t()
        first = client.get(keys[0], device=dev) if out is None else client.get(keys[0], out=out)
        assert first is not None
        snapshot = first.clone()
        for i in range(ALIAS_GETS):
            key = keys[1 + i % (len(keys) - 1)]
            if out is None:
                client.get(key, device=dev)
            else:
                client.get(key, out=torch.empty(shape[::-1], dtype=DTYPE).t())
        backend.sync()
        if not (same_bits(first, snapshot) and same_bits(first, entries.refs[keys[0]])):
            bad.append(f"sync {name}")
        held = loop.run_until_complete(aclient.get_many(keys, device=dev))
        snapshots = [t.clone() for t in held if t is not None]
        for _ in range(math.ceil(ALIAS_GETS / len(keys))):
            loop.run_until_complete(aclient.get_many(keys[::-1], device=dev))
        backend.sync()
        for key, t, s in zip(keys, held, snapshots, strict=True):
            if t is None or not (same_bits(t, s) and same_bits(t, entries.refs[key])):
                bad.append(f"async {key}")
    staged: int | None = None
    if pool is not None and before is not None:
        after = pool.stats()
        staged = after["allocated"] + after["reused"] - before["allocated"] - before["reused"]
    run.check(
        f"results survive the next {ALIAS_GETS} GETs unchanged (never alias pooled buffers)",
        not bad and staged != 0,
        f"{len(entries.keys)} sizes, sync and async 8 at a time; "
        + (f"{staged} staged GETs" if staged is not None else "staging pool not exposed")
        + (f"; changed: {bad}" if bad else "")
        + ("; the staging pool was never used" if staged == 0 else ""),
    )


def keep_busy(dev: torch.device) -> None:
    """Queue about a second of work on the current (default) stream."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(BUSY_CYCLES)
        return
    a = torch.randn(8192, 8192, device=dev, dtype=DTYPE) / 90.5
    for _ in range(700):  # ~1.4 ms each on an H200
        a = a @ a


def check_streams(
    run: Run,
    client: ec_cache.Client,
    aclient: ec_cache.AsyncClient,
    loop: asyncio.AbstractEventLoop,
    entries: Entries,
) -> None:
    backend = run.backend
    if not backend.cuda:
        run.check("safe on the caller's current stream (no extra synchronisation)", None, "no CUDA")
        run.check("Client.get_many(device=) safe on the caller's current stream", None, "no CUDA")
        run.check('device="cuda" lands on the current device', None, "no CUDA")
        return
    dev = backend.device
    side = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
    bad: list[str] = []
    bad_many: list[str] = []
    for name, keys in entries.keys.items():
        key, ref = keys[0], entries.refs[keys[0]]
        out = torch.zeros_like(ref)
        backend.sync()
        # Keep the default stream busy for about a second, longer than the GETs below
        # take: a copy wrongly queued there would land after the comparisons (queued on
        # the side stream) have run.
        keep_busy(dev)
        with torch.cuda.stream(side):
            fresh = client.get(key, device=dev)
            into = client.get(key, out=out)
            many = loop.run_until_complete(aclient.get_many(keys, device=dev))
            # torch.equal runs on the current (side) stream, with no synchronisation.
            if fresh is None or not same_bits(fresh, ref):
                bad.append(f"get {name}")
            if into is None or not same_bits(into, ref):
                bad.append(f"get(out=) {name}")
            for k, t in zip(keys, many, strict=True):
                if t is None or not same_bits(t, entries.refs[k]):
                    bad.append(f"async {k}")
        backend.sync()
        keep_busy(dev)
        with torch.cuda.stream(side):
            # get_many runs its GETs on worker threads, whose current stream is not
            # the caller's: the copies must still be ordered before the caller's work.
            pooled = client.get_many(keys, device=dev)
            for k, t in zip(keys, pooled, strict=True):
                if t is None or not same_bits(t, entries.refs[k]):
                    bad_many.append(k)
        backend.sync()
    run.check(
        "safe on the caller's current stream (no extra synchronisation)",
        not bad,
        "get, get(out=), AsyncClient.get_many and comparisons on a side stream while the "
        "default stream is busy" + (f"; wrong: {bad}" if bad else ""),
    )
    run.check(
        "Client.get_many(device=) safe on the caller's current stream",
        not bad_many,
        "same, through the blocking client's worker threads"
        + (f"; wrong before a synchronize: {bad_many}" if bad_many else ""),
    )
    index = torch.cuda.device_count() - 1
    key = next(iter(entries.keys.values()))[0]
    with torch.cuda.device(index):
        t = client.get(key, device="cuda")
        ta = loop.run_until_complete(aclient.get(key, device="cuda"))
        want = torch.device("cuda", torch.cuda.current_device())
    ok = t is not None and ta is not None and t.device == want and ta.device == want
    run.check(
        'device="cuda" lands on the current device',
        ok,
        f"current device cuda:{index}; got {t.device if t is not None else None} (sync), "
        f"{ta.device if ta is not None else None} (async)",
    )


# -- save path ---------------------------------------------------------------------------
class Compute:
    """A loop of matrix products on the default stream. At most two groups of four
    products are left queued ahead (an event per group), as an inference loop that
    syncs with its GPU every step would, so that other threads get the GIL."""

    def __init__(self, backend: Backend, n: int) -> None:
        self.backend = backend
        dtype = DTYPE if backend.cuda else torch.float32
        self.a = torch.randn(n, n, device=backend.device, dtype=dtype) / math.sqrt(n)
        self.c = torch.empty_like(self.a)
        self.n = n

    def loop(
        self, iters: int, hook: Callable[[int], None] | None = None, max_s: float = math.inf
    ) -> tuple[float, int]:
        """Run ``iters`` products (fewer once ``max_s`` seconds have passed); returns
        the seconds and the products done."""
        backend = self.backend
        pending: deque[Any] = deque()
        backend.sync()
        t0 = time.perf_counter()
        done = 0
        for i in range(iters):
            if time.perf_counter() - t0 > max_s:
                break
            torch.matmul(self.a, self.a, out=self.c)
            done += 1
            if hook is not None:
                hook(i)
            if backend.cuda and i % 4 == 3:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
                pending.append(event)
                if len(pending) > 2:
                    pending.popleft().synchronize()
        backend.sync()
        return time.perf_counter() - t0, done

    def calibrate(self, seconds: float) -> tuple[int, float]:
        self.loop(8)
        probe = 40 if self.backend.cuda else 20
        per = min(self.loop(probe)[0] / probe for _ in range(2))
        return max(8, int(seconds / per)), per


class Saver:
    """Background ``Client.put`` of CUDA tensors under fresh keys until stopped."""

    def __init__(
        self,
        client: ec_cache.Client,
        tensors: list[torch.Tensor],
        prefix: str,
        side_stream: Any = None,
    ) -> None:
        self.client, self.tensors, self.prefix, self.side = client, tensors, prefix, side_stream
        self.stop = threading.Event()
        self.done = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, name="bench-saver", daemon=True)

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            tensor = self.tensors[n % len(self.tensors)]
            try:
                if self.side is not None:
                    with torch.cuda.stream(self.side):
                        self.side.wait_stream(torch.cuda.default_stream(tensor.device))
                        self.client.put(f"{self.prefix}-{n}", tensor)
                else:
                    self.client.put(f"{self.prefix}-{n}", tensor)
                self.done += 1
            except Exception as exc:  # reported, not raised: the thread must end cleanly
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return
            n += 1


def save_section(run: Run, url: str) -> None:
    backend, p = run.backend, run.params
    section: dict[str, Any] = {"shape": list(p.save_shape), "variants": {}}
    run.results["save"] = section
    nbytes = math.prod(p.save_shape) * DTYPE.itemsize
    section["nbytes"] = nbytes
    tensors = [backend.random(p.save_shape, seed=9000 + i) for i in range(4)]
    compute = Compute(backend, p.matmul_n)
    iters, per = compute.calibrate(p.compute_s)
    flops = 2 * p.matmul_n**3
    section["matmul"] = {
        "n": p.matmul_n,
        "dtype": str(compute.a.dtype).removeprefix("torch."),
        "iters": iters,
        "probe_ms_per_product": per * 1000,
        "probe_tflops": flops / per / 1e12,
    }
    print(f"  matmul {p.matmul_n}: {per * 1000:.2f} ms/product, {iters} per loop", flush=True)
    # Rates (products per second), so that a loop cut at max_s still counts.
    cap = 4 * p.compute_s
    alone: list[float] = []

    def timed(hook: Callable[[int], None] | None = None) -> tuple[float, float]:
        seconds, done = compute.loop(iters, hook, cap)
        return seconds, done / seconds

    client = ec_cache.Client(url, model=MODEL, dtype=DTYPE)
    shim = vllm_shim.install()
    from ec_cache.vllm import ECCacheConnector  # after the shim: vLLM may be absent
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    section["vllm"] = "bench/vllm_shim.py stand-ins" if shim else "vLLM"
    try:
        for variant in SAVE_VARIANTS:
            if run.left() < 0:
                section["truncated"] = "time budget"
                break
            alone.append(timed()[1])  # interleaved: alone before each variant
            row: dict[str, Any] = {"label": SAVE_VARIANTS[variant]}
            if variant.startswith("put_thread"):
                side = (
                    torch.cuda.Stream(device=backend.device)  # type: ignore[no-untyped-call]
                    if backend.cuda and variant.endswith("side_stream")
                    else None
                )
                saver = Saver(client, tensors, f"save-{variant}", side)
                saver.thread.start()
                while saver.done == 0 and not saver.errors and run.left() > -30:
                    time.sleep(0.001)  # the first PUT in flight: connections are warm
                start_done = saver.done
                seconds, rate = timed()
                saves = saver.done - start_done
                saver.stop.set()
                saver.thread.join(60)
                row["saves_total"] = saver.done
                row["errors"] = saver.errors
            else:
                conn = ECCacheConnector(
                    vllm_shim.vllm_config(
                        {"url": url, "model": MODEL, "dtype": "bfloat16", "save": True},
                        model=MODEL,
                        dtype="bfloat16",
                    ),
                    ECConnectorRole.WORKER,
                )
                every = max(1, round(p.save_every_s / per))
                count = [0]

                def hook(
                    i: int, conn: Any = conn, every: int = every, count: list[int] = count
                ) -> None:
                    if i % every == 0:
                        count[0] += 1
                        mm_hash = f"conn-{count[0]}"
                        conn.save_caches({mm_hash: tensors[count[0] % len(tensors)]}, mm_hash)

                hook(0)  # the first save (side stream, uploader threads) before timing
                conn.flush(60)
                before = conn.counters().get("save_created", 0)
                seconds, rate = timed(hook)
                saves = int(conn.counters().get("save_created", 0) - before)
                row["save_every_products"] = every
                row["flushed"] = conn.flush(60)
                row["counters"] = {k: v for k, v in conn.counters().items() if k.startswith("save")}
                conn.shutdown()
            row.update(seconds=seconds, products_per_s=rate, saves_during=saves)
            row["save_mb_per_s_during"] = saves * nbytes / seconds / 1e6
            section["variants"][variant] = row
        alone.append(timed()[1])  # and once after the last
        section["alone_products_per_s"] = alone
        base = statistics.median(alone) if alone else float("nan")
        for row in section["variants"].values():
            row["speed_vs_alone"] = row["products_per_s"] / base
            print(
                f"  {row['label']}: {row['speed_vs_alone']:.3f}x alone, "
                f"{row['saves_during']} saves ({row['save_mb_per_s_during']:.0f} MB/s)",
                flush=True,
            )
    finally:
        client.close()
    run.write()


# -- targets and report ------------------------------------------------------------------
def targets(run: Run) -> list[dict[str, Any]]:
    judged = run.backend.cuda
    rows: list[dict[str, Any]] = []
    for name, entry in run.results.get("get", {}).items():
        if not isinstance(entry, dict) or "ratio_to_a" not in entry:
            continue
        ratio = entry["ratio_to_a"]["c_get_device"]
        rows.append(
            {
                "target": f"c >= {GET_TARGET}x a ({name})",
                "value": round(ratio, 3),
                "pass": (ratio >= GET_TARGET) if judged else None,
            }
        )
    for variant, row in run.results.get("save", {}).get("variants", {}).items():
        if "speed_vs_alone" not in row:
            continue
        speed = row["speed_vs_alone"]
        rows.append(
            {
                "target": f"matmul >= {SAVE_TARGET}x alone during saves: {SAVE_VARIANTS[variant]}",
                "value": round(speed, 3),
                "pass": (speed >= SAVE_TARGET and row["saves_during"] > 0) if judged else None,
            }
        )
    return rows


def markdown(results: dict[str, Any]) -> str:
    meta = results.get("meta", {})
    mode = "CUDA" if meta.get("device", "").startswith("cuda") else "CPU mode (not GPU figures)"
    lines = [
        f"# GPU path: {meta.get('gpu', 'no GPU')}, {meta.get('when_utc', '?')} UTC",
        "",
        f"{mode}; torch {meta.get('torch')}, CUDA {meta.get('cuda', '-')}, "
        f"{meta.get('cpus')} CPUs, Python {meta.get('python')}, quick={meta.get('quick')}, "
        f"{results.get('elapsed_s', '?')} s. Server: `python -m app`, disk tier, loopback.",
        "",
    ]
    get = {k: v for k, v in results.get("get", {}).items() if isinstance(v, dict)}
    if get:
        names = list(get)
        lines += [
            "## GET, disk hits, MB/s (median of rounds; ratio to a)",
            "",
            "| method | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for m, text in METHODS.items():
            cells = [
                f"{get[n]['methods'][m]['mb_per_s_median']:.0f} ({get[n]['ratio_to_a'][m]:.2f}x)"
                for n in names
            ]
            lines.append(f"| {text} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append(
            "p50 ms per request (d: per batch of 8): "
            + "; ".join(
                f"{n}: "
                + ", ".join(
                    f"{m.split('_')[0]} {get[n]['methods'][m]['p50_ms']:.1f}" for m in METHODS
                )
                for n in names
            )
        )
        lines.append("")
    save = results.get("save", {})
    if save.get("variants"):
        mm = save["matmul"]
        lines += [
            f"## Save path: {save['nbytes'] / 1e6:.1f} MB entries during a matmul loop",
            "",
            f"{mm['iters']} products of {mm['n']}x{mm['n']} {mm['dtype']} per loop "
            f"({mm['probe_ms_per_product']:.2f} ms each, {mm['probe_tflops']:.0f} TFLOP/s); "
            f"alone: {', '.join(f'{r:.0f}' for r in save['alone_products_per_s'])} products/s; "
            f"{save['vllm']}.",
            "",
            "| saves by | products/s | speed vs alone | saves during | save MB/s |",
            "|---|---|---|---|---|",
        ]
        for row in save["variants"].values():
            lines.append(
                f"| {row['label']} | {row['products_per_s']:.0f} | "
                f"{row.get('speed_vs_alone', 0):.3f}x "
                f"| {row['saves_during']} | {row['save_mb_per_s_during']:.0f} |"
            )
        lines.append("")
    if results.get("checks"):
        lines += ["## Checks", "", "| check | result | detail |", "|---|---|---|"]
        for c in results["checks"]:
            mark = {True: "PASS", False: "FAIL", None: "n/a"}[c["pass"]]
            lines.append(f"| {c['name']} | {mark} | {c['detail']} |")
        lines.append("")
    if results.get("targets"):
        lines += ["## Targets", "", "| target | value | result |", "|---|---|---|"]
        for t in results["targets"]:
            mark = {True: "PASS", False: "MISS", None: "not judged (CPU)"}[t["pass"]]
            lines.append(f"| {t['target']} | {t['value']} | {mark} |")
        lines.append("")
    if results.get("error"):
        lines += ["## Error", "", "```", results["error"], "```", ""]
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "bench" / "results" / "gpu",
        help="folder for gpu.json and gpu.md (default bench/results/gpu)",
    )
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (logic only)")
    parser.add_argument("--quick", action="store_true", help="small entries, few rounds")
    parser.add_argument("--device", default="cuda:0", help="the CUDA device (default cuda:0)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="stop starting new rounds/sections after this many seconds (default 420)",
    )
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("CUDA is not available here: use --cpu for the CPU mode")
    backend = Backend(torch.device("cpu") if args.cpu else torch.device(args.device))
    if backend.cuda:
        torch.cuda.set_device(backend.device)
    run = Run(
        out=args.out,
        backend=backend,
        params=Params.of(quick=args.quick, cuda=backend.cuda),
        quick=args.quick,
        deadline=time.monotonic() + args.budget_s,
    )
    run.results["meta"] = {**machine(backend), "quick": args.quick}
    work = Path(tempfile.mkdtemp(prefix="ec-gpu-bench-"))
    server = ServerProcess(
        work / "data", work / "server.log", disk_max_bytes="8GiB", max_body_bytes="1GiB"
    )
    loop = asyncio.new_event_loop()
    client: ec_cache.Client | None = None
    aclient: ec_cache.AsyncClient | None = None
    failed = False
    try:
        server.start()
        client = ec_cache.Client(server.url, model=MODEL, dtype=DTYPE)
        aclient = ec_cache.AsyncClient(server.url, model=MODEL, dtype=DTYPE)
        print(f"ec-cache on {server.url}; device {backend.device}", flush=True)
        entries = store_entries(run, client)
        print("GET", flush=True)
        get_section(run, client, aclient, loop, entries)
        print("checks", flush=True)
        check_bytes(run, client, aclient, loop, entries)
        check_no_alias(run, client, aclient, loop, entries)
        check_streams(run, client, aclient, loop, entries)
        run.write()
        del entries
        print("save path", flush=True)
        save_section(run, server.url)
    except Exception as exc:
        import traceback

        failed = True
        run.results["error"] = traceback.format_exc()
        log = work / "server.log"
        if log.exists():
            run.results["server_log_tail"] = log.read_text(errors="replace")[-4000:]
        print(f"error: {exc}", file=sys.stderr, flush=True)
    finally:
        if client is not None:
            client.close()
        if aclient is not None:
            loop.run_until_complete(aclient.aclose())
        loop.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        run.results["meta"]["loadavg_end"] = list(os.getloadavg())
        run.write()
    print()
    print((run.out / "gpu.md").read_text())
    print(f"written: {run.out / 'gpu.json'}, {run.out / 'gpu.md'}")
    if failed or any(c["pass"] is False for c in run.checks):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
