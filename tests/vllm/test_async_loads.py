"""Asynchronous loads (``load_mode: async``, the default on vLLM 0.33): the scheduler
defers a request until every worker rank holds its cached items in host memory, and
``start_load_caches`` only copies them to the device.

The connectors are vLLM 0.33's factory's, driven step by step through vLLM's own
worker-side context and rank aggregator (``engine_loop.EngineLoop``), against a real
ec-cache server; a fault proxy in front of it holds requests back or breaks them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="tests/vllm run in .venv-vllm (scripts/setup-vllm-venv.sh)")

import time
from collections.abc import Callable, Iterator

import ec_cache.vllm as ecv
import torch
from conftest import Server
from ec_cache.vllm import ECCacheConnector, ECCacheConnectorMetadata
from engine_loop import EngineLoop
from helpers import (
    DTYPE,
    SCHED,
    WORKER,
    delete_raw,
    embeds,
    make_request,
    mm_hash,
    ns,
    prefetcher_of,
    put_raw,
)
from vllm.v1.core.sched.output import SchedulerOutput

from testkit.fault_proxy import FaultProxy
from testkit.polling import wait_for

# The scheduler waits for each existence answer, so that a step's decision never
# depends on how fast this machine is (the background question: its own test).
WAIT = {"exists_wait_s": 5}
BYTES = 16 * 32 * 2  # one entry of embeds(): 16 rows of 32 bfloat16


@pytest.fixture
def proxy(server: Server) -> Iterator[FaultProxy]:
    with FaultProxy(server.url) as fault_proxy:
        yield fault_proxy


def meta_of(step_output: SchedulerOutput) -> ECCacheConnectorMetadata:
    meta = step_output.ec_connector_metadata
    assert isinstance(meta, ECCacheConnectorMetadata)
    return meta


def wait_for_counts(condition: Callable[[], object], what: str) -> None:
    """The prefetcher's threads answer within milliseconds: poll finely, 10 s at most."""
    wait_for(condition, what, timeout=10, interval=0.01)


@pytest.mark.parametrize("width_known", [False, True], ids=["head-first", "width-known"])
def test_request_waits_for_its_prefetch_then_loads_from_host(
    server: Server,
    proxy: FaultProxy,
    connector: Callable[..., ECCacheConnector],
    monkeypatch: pytest.MonkeyPatch,
    width_known: bool,
) -> None:
    model, h, stored = ns(), mm_hash(), embeds(seed=3)
    put_raw(server, model, h, stored)
    extra = {"url": proxy.url, "model": model, "dtype": DTYPE, **WAIT}
    widths = {"image": 32} if width_known else None
    sched = connector(SCHED, extra, widths=widths)
    worker = connector(WORKER, extra, widths=widths)
    assert sched.async_loads and worker.async_loads
    loop = EngineLoop(sched, [worker], monkeypatch)
    proxy.configure(mode="slow", delay_s=0.3)  # the GET is held back
    req = make_request([h], req_id="r-img")

    first = loop.run([req])
    assert first.deferred == ["r-img"]
    meta = meta_of(first.output)
    assert [(o.mm_hash, o.num_embeds, o.width) for o in meta.prefetch] == [
        (h, 16, 32 if width_known else None)
    ]
    assert meta.loads == []
    step = loop.run_until_scheduled([req])
    assert [load.mm_hash for load in meta_of(step.output).loads] == [h]
    assert step.computed == {}
    loaded = loop.caches[0][h]
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded, stored)
    # One GET, in the background; the step that loaded it only copied host memory.
    assert proxy.seen["GET entry"] == 1
    assert proxy.seen["HEAD entry"] == (0 if width_known else 1)
    w, s = worker.counters(), sched.counters()
    assert w["prefetch_fetched"] == 1 and w["prefetch_fetch_bytes"] == BYTES
    assert w["load_prefetched"] == 1 and w["load_items"] == 1
    assert s["prefetch_started"] == 1 and s["prefetch_ready"] == 1
    assert s["deferred_requests"] == 1 and s["deferred_seconds"] > 0
    # Nothing is kept past its use.
    loop.run([])
    assert prefetcher_of(worker).held_bytes == 0
    assert sched.counters()["prefetch_bytes_held"] == 0


def test_requests_without_cached_items_are_not_deferred(
    server: Server, connector: Callable[..., ECCacheConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = {"url": server.url, "model": ns(), "dtype": DTYPE, **WAIT}
    sched, worker = connector(SCHED, extra), connector(WORKER, extra)
    loop = EngineLoop(sched, [worker], monkeypatch)
    req = make_request([mm_hash(), mm_hash()], req_id="r-miss")
    step = loop.run([req])
    assert step.scheduled == ["r-miss"] and step.computed == {"r-miss": [0, 1]}
    assert meta_of(step.output).prefetch == []
    assert "deferred_requests" not in sched.counters()


def test_the_existence_question_defers_the_request_not_the_scheduler(
    server: Server,
    proxy: FaultProxy,
    blackhole: str,
    connector: Callable[..., ECCacheConnector],
) -> None:
    model, h = ns(), mm_hash()
    put_raw(server, model, h, embeds())
    proxy.configure(exists_delay_s=0.5)
    sched = connector(
        SCHED, {"url": proxy.url, "model": model, "dtype": DTYPE, "exists_timeout_s": 5,
                "load_mode": "sync"},
    )  # fmt: skip
    req = make_request([h])
    # The answer takes 0.5 s: the call returns without it and the request waits.
    assert sched.ensure_cache_available(req, 0) is False
    assert "exists_requests" not in sched.counters()
    while not sched.ensure_cache_available(req, 0):
        sched.build_connector_meta(SchedulerOutput.make_empty())
        time.sleep(0.02)
    assert sched.has_cache_item(h) is True
    c = sched.counters()
    assert c["exists_requests"] == 1 and c["deferred_requests"] == 1
    assert proxy.seen["POST exists"] == 1

    # A server that never answers: deferred until the timeout, then a miss (computed).
    dead = connector(
        SCHED, {"url": blackhole, "model": ns(), "dtype": DTYPE, "exists_timeout_s": 0.1},
    )  # fmt: skip
    req = make_request([mm_hash()])
    assert dead.ensure_cache_available(req, 0) is False
    while not dead.ensure_cache_available(req, 0):
        dead.build_connector_meta(SchedulerOutput.make_empty())
        time.sleep(0.02)
    assert dead.has_cache_item(req.mm_features[0].identifier) is False
    c = dead.counters()
    assert c["exists_failed"] == 1 and c["misses_outage"] == 1


# fault -> (proxy mode, stored entry's rows and width, encoder width vLLM measured)
FAULTS = {
    "503": ("503", (16, 32), None),
    "reset": ("reset", (16, 32), None),
    "corrupt": ("corrupt", (16, 32), None),
    "timeout": ("slow", (16, 32), None),
    "deleted": ("slow", (16, 32), None),
    "rows-seen-by-head": ("pass", (8, 32), None),
    "rows-seen-by-get": ("pass", (8, 32), 32),
    "width-seen-by-get": ("pass", (16, 48), 32),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_prefetch_is_computed(
    server: Server,
    proxy: FaultProxy,
    connector: Callable[..., ECCacheConnector],
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    """503, a reset connection, a body failing its CRC32C, a GET past the deadline, an
    entry deleted after the scheduler asked, an entry of other rows or width than vLLM
    expects (seen by the HEAD, or by the GET into a buffer of the expected shape): the
    item becomes a miss, the encoder computes it, nothing is loaded."""
    mode, (rows, width), measured = FAULTS[fault]
    model, h = ns(), mm_hash()
    put_raw(server, model, h, embeds(rows=rows, width=width))
    widths = {"image": measured} if measured else None
    extra = {"url": proxy.url, "model": model, "dtype": DTYPE, "load_timeout_s": 1, **WAIT}
    sched = connector(SCHED, extra, widths=widths)
    worker = connector(WORKER, extra, widths=widths)
    loop = EngineLoop(sched, [worker], monkeypatch)
    proxy.configure(mode=mode, delay_s=0.3 if fault == "deleted" else 30)
    req = make_request([h], req_id="r-fail")
    assert loop.run([req]).deferred == ["r-fail"]
    if fault == "deleted":  # while the GET is held back
        delete_raw(server, model, h)
    step = loop.run_until_scheduled([req])
    assert step.computed == {"r-fail": [0]}
    assert meta_of(step.output).loads == [] and loop.caches[0] == {}
    assert sched.counters()["prefetch_failed"] == 1
    assert "prefetch_ready" not in sched.counters()
    w = worker.counters()
    assert "load_items" not in w and "prefetch_fetched" not in w
    if fault != "timeout":  # (a timeout may be the scheduler's deadline first)
        assert w["prefetch_fetch_failed"] == 1


def test_tensor_parallel_waits_for_every_rank(
    server: Server,
    proxy: FaultProxy,
    connector: Callable[..., ECCacheConnector],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, h, h2 = ns(), mm_hash(), mm_hash()
    put_raw(server, model, h, embeds(seed=1))
    put_raw(server, model, h2, embeds(seed=2))
    direct = {"url": server.url, "model": model, "dtype": DTYPE, "load_timeout_s": 2, **WAIT}
    sched = connector(SCHED, direct, tensor_parallel_size=2)
    rank0 = connector(WORKER, direct, tensor_parallel_size=2)
    # Rank 1's GETs go through the proxy: held back, then failing.
    rank1 = connector(WORKER, {**direct, "url": proxy.url}, tensor_parallel_size=2)
    loop = EngineLoop(sched, [rank0, rank1], monkeypatch)
    proxy.configure(mode="slow", delay_s=0.5)

    req = make_request([h], req_id="r-tp")
    assert loop.run([req]).deferred == ["r-tp"]
    wait_for_counts(lambda: rank0.counters().get("prefetch_fetched") == 1, "rank 0's fetch")
    assert loop.run([req]).deferred == ["r-tp"]  # rank 0 holds it, rank 1 not yet
    step = loop.run_until_scheduled([req])
    assert step.computed == {}
    for rank, cache in zip((rank0, rank1), loop.caches, strict=True):
        assert torch.equal(cache[h], embeds(seed=1))
        assert rank.counters()["load_prefetched"] == 1

    # One rank fails: a miss for every rank (all compute it), the other's copy released.
    proxy.configure(mode="503")
    req2 = make_request([h2], req_id="r-tp2")
    step = loop.run_until_scheduled([req2])
    assert step.computed == {"r-tp2": [0]}
    assert sched.counters()["prefetch_failed"] == 1
    loop.run([])
    assert rank0.counters()["prefetch_dropped"] == 1
    assert prefetcher_of(rank0).held_bytes == 0
    assert h2 not in loop.caches[0] and h2 not in loop.caches[1]


def test_prefetches_are_released_when_nobody_waits(
    server: Server,
    proxy: FaultProxy,
    connector: Callable[..., ECCacheConnector],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finished or aborted (vLLM calls request_finished for both) while held or still
    being fetched, or preempted between two prefill chunks: released."""
    model = ns()
    held, in_flight, later = mm_hash(), mm_hash(), mm_hash()
    first_chunk = mm_hash()
    for i, h in enumerate((held, in_flight, later, first_chunk)):
        put_raw(server, model, h, embeds(seed=i))
    extra = {"url": proxy.url, "model": model, "dtype": DTYPE, **WAIT}
    sched, worker = connector(SCHED, extra), connector(WORKER, extra)
    loop = EngineLoop(sched, [worker], monkeypatch)

    a = make_request([held], req_id="r-a")
    assert loop.run([a]).deferred == ["r-a"]
    wait_for_counts(lambda: worker.counters().get("prefetch_fetched") == 1, "the fetch")
    loop.run([])
    assert sched.counters()["prefetch_bytes_held"] == BYTES
    sched.request_finished(a)
    assert len(meta_of(loop.run([]).output).release) == 1
    assert worker.counters()["prefetch_dropped"] == 1
    loop.run([])
    assert sched.counters()["prefetch_bytes_held"] == 0

    proxy.configure(mode="slow", delay_s=0.5)
    b = make_request([in_flight], req_id="r-b")
    assert loop.run([b]).deferred == ["r-b"]
    wait_for_counts(lambda: proxy.seen["GET entry"] == 2, "the second entry GET")
    loop.run([])  # its report: the bytes reserved for the GET in flight
    assert sched.counters()["prefetch_bytes_held"] == BYTES
    sched.request_finished(b)  # aborted while its GET is held back
    loop.run([])  # the release goes out, and the engine is idle from now on
    assert worker.counters()["prefetch_dropped"] == 2
    # Freed with the release, not when the GET ends: the only report the scheduler
    # gets before the engine idles (that of this step) is true.
    assert prefetcher_of(worker).held_bytes == 0
    assert sched.counters()["prefetch_bytes_held"] == 0

    proxy.configure(mode="pass")
    c = make_request([first_chunk, later], req_id="r-c")
    # Both held; the first prefill chunk covers the first item only.
    step = loop.run_until_scheduled([c], chunk={"r-c": [0]})
    assert [load.mm_hash for load in meta_of(step.output).loads] == [first_chunk]
    step = loop.run([], preempted={"r-c"})
    assert len(meta_of(step.output).release) == 1
    assert prefetcher_of(worker).held_bytes == 0
    assert sched.counters()["prefetch_released"] == 3
    assert worker.counters()["prefetch_dropped"] == 3
    assert worker.counters()["prefetch_fetched"] == 3  # the abandoned GET: never held


def test_an_idle_engine_loads_synchronously(
    server: Server,
    proxy: FaultProxy,
    connector: Callable[..., ECCacheConnector],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step that runs nothing carries no metadata to the workers and brings no
    report back: the waiting items are loaded in the step that schedules them (it
    stalls nobody), joining a prefetch already under way."""
    model, cold, warm = ns(), mm_hash(), mm_hash()
    put_raw(server, model, cold, embeds(seed=1))
    put_raw(server, model, warm, embeds(seed=2))
    extra = {"url": proxy.url, "model": model, "dtype": DTYPE, **WAIT}
    sched, worker = connector(SCHED, extra), connector(WORKER, extra)
    loop = EngineLoop(sched, [worker], monkeypatch)

    a = make_request([cold], req_id="r-idle")
    first = loop.run([a], others_running=False)
    assert first.deferred == ["r-idle"] and first.output.total_num_scheduled_tokens == 0
    step = loop.run([a], others_running=False)
    assert step.scheduled == ["r-idle"] and step.computed == {}
    assert meta_of(step.output).prefetch == []
    assert torch.equal(loop.caches[0][cold], embeds(seed=1))
    assert worker.counters()["load_items"] == 1 and "load_prefetched" not in worker.counters()

    proxy.configure(mode="slow", delay_s=0.5)
    b = make_request([warm], req_id="r-join")
    assert loop.run([b]).deferred == ["r-join"]  # shipped; then the others finish
    assert loop.run([b], others_running=False).deferred == ["r-join"]
    step = loop.run([b], others_running=False)
    assert step.scheduled == ["r-join"]
    assert torch.equal(loop.caches[0][warm], embeds(seed=2))
    assert worker.counters()["load_prefetched"] == 1
    assert proxy.seen["GET entry"] == 2  # one per entry: the load joined the prefetch
    assert sched.counters()["prefetch_sync"] == 2


def test_the_byte_budget_bounds_host_memory(
    server: Server,
    connector: Callable[..., ECCacheConnector],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = ns()
    x, y, z, w, big = (mm_hash() for _ in range(5))
    for i, h in enumerate((x, y, z, w)):
        put_raw(server, model, h, embeds(seed=i))
    put_raw(server, model, big, embeds(rows=32))
    extra = {"url": server.url, "model": model, "dtype": DTYPE, "prefetch_buffer_bytes": BYTES,
             "load_timeout_s": 1, **WAIT}  # fmt: skip
    sched, worker = connector(SCHED, extra), connector(WORKER, extra)
    loop = EngineLoop(sched, [worker], monkeypatch)

    # Room for one entry: the second waits until the first is taken by its load.
    waiting = [make_request([x], req_id="r-x"), make_request([y], req_id="r-y")]
    assert loop.run(waiting[:1]).deferred == ["r-x"]
    wait_for_counts(lambda: worker.counters().get("prefetch_fetched") == 1, "the fetch")
    assert loop.run(waiting[1:]).deferred == ["r-y"]
    wait_for_counts(
        lambda: worker.counters().get("prefetch_budget_waits") == 1, "a wait for budget"
    )
    while waiting:
        step = loop.run(waiting)
        assert step.computed == {}
        waiting = [r for r in waiting if r.request_id in step.deferred]
    counts = worker.counters()
    assert counts["prefetch_budget_waits"] == 1 and counts["load_prefetched"] == 2

    # Larger than the whole budget: computed at once. Queued behind an entry nobody
    # takes: computed at the deadline.
    c = make_request([big], rows=32, req_id="r-big")
    assert loop.run_until_scheduled([c]).computed == {"r-big": [0]}
    held, queued = make_request([z], req_id="r-held"), make_request([w], req_id="r-queued")
    assert loop.run([held]).deferred == ["r-held"]
    wait_for_counts(lambda: worker.counters()["prefetch_fetched"] == 3, "three fetches")
    assert loop.run_until_scheduled([queued]).computed == {"r-queued": [0]}
    assert sched.counters()["prefetch_failed"] == 2
    assert prefetcher_of(worker).held_bytes <= BYTES


@pytest.mark.parametrize("why", ["load_mode: sync", "a vLLM without the hooks"])
def test_synchronous_loads(
    server: Server,
    connector: Callable[..., ECCacheConnector],
    monkeypatch: pytest.MonkeyPatch,
    why: str,
) -> None:
    model, h = ns(), mm_hash()
    put_raw(server, model, h, embeds())
    extra = {"url": server.url, "model": model, "dtype": DTYPE, **WAIT}
    if why == "load_mode: sync":
        extra["load_mode"] = "sync"
    else:
        monkeypatch.setattr(ecv, "ASYNC_LOAD_HOOKS", False)
    sched, worker = connector(SCHED, extra), connector(WORKER, extra)
    assert not sched.async_loads and not worker.async_loads
    loop = EngineLoop(sched, [worker], monkeypatch)
    step = loop.run([make_request([h], req_id="r-sync")])
    assert step.scheduled == ["r-sync"] and step.computed == {}
    assert meta_of(step.output).prefetch == []
    assert torch.equal(loop.caches[0][h], embeds())
    assert worker.counters()["load_items"] == 1 and "load_prefetched" not in worker.counters()
    assert worker.build_connector_worker_meta() is None
