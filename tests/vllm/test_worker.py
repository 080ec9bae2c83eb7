"""The connector's worker role (``ec_cache._vllm.worker`` and its prefetcher) through
``ECCacheConnector`` built by vLLM 0.33's factory for ``WORKER``, or the prefetcher
itself, against a real ec-cache server or a hostile one: loads, shapes, uploads,
failures, the byte budget and deadlines.

The only substitution is the tensor-parallel rank of a second worker in one process
(``_tensor_parallel_rank``), since two TP ranks cannot share one process.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="tests/vllm run in .venv-vllm (scripts/setup-vllm-venv.sh)")

import dataclasses
import pickle
import time
from collections.abc import Callable
from typing import Any

import ec_cache
import ec_cache._vllm.worker as ec_worker
import torch
from conftest import Server
from ec_cache._buffers import BufferPool
from ec_cache._crc import crc32c
from ec_cache._vllm.counters import Counters
from ec_cache._vllm.planner import PrefetchOrder
from ec_cache._vllm.prefetch import Prefetcher, PrefetchReport
from ec_cache.vllm import ECCacheConnector, ECCacheConnectorMetadata
from engine_loop import EngineLoop
from helpers import (
    DTYPE,
    SCHED,
    SYNC,
    WORKER,
    delete_raw,
    embeds,
    get_raw,
    make_request,
    mm_hash,
    ns,
    put_raw,
    step,
    tiny_model_config,
)

from testkit.polling import wait_for
from tests.client.hostile import HostileServer, body_of

BYTES = 16 * 32 * 2  # one entry of embeds(): 16 rows of 32 bfloat16


def test_worker_saves_in_background_and_loads_equal_tensors(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    model = ns()
    extra = {"url": server.url, "model": model, "dtype": DTYPE, **SYNC}
    producer = connector(WORKER, extra)
    outputs = {mm_hash(): embeds(rows=16, seed=i) for i in range(3)}
    encoder_cache = dict(outputs)
    t0 = time.monotonic()
    for h in outputs:
        producer.save_caches(encoder_cache, h)
    assert time.monotonic() - t0 < 0.5  # enqueue only
    assert producer.flush(timeout=20)
    for h, t in outputs.items():  # observed on the server
        stored = get_raw(server, model, h)
        assert stored is not None and torch.equal(stored, t)
    c = producer.counters()
    assert c["save_created"] == 3 and c["save_bytes"] == 3 * 16 * 32 * 2, c
    # Saving again is skipped locally (already known to be stored).
    producer.save_caches(encoder_cache, next(iter(outputs)))
    assert producer.counters()["save_skipped_known"] == 1

    sched = connector(SCHED, extra)
    consumer = connector(WORKER, extra)
    req = make_request(list(outputs), rows=16)
    out, meta = step(sched, [req])
    assert len(meta.loads) == 3 and out.scheduled_encoder_inputs == {}
    shipped = pickle.loads(pickle.dumps(out))  # scheduler -> worker process
    consumer.bind_connector_metadata(shipped.ec_connector_metadata)
    loaded: dict[str, torch.Tensor] = {}
    consumer.start_load_caches(loaded)
    consumer.clear_connector_metadata()
    assert loaded.keys() == outputs.keys()
    for h, t in outputs.items():
        assert loaded[h].device.type == "cpu"
        assert loaded[h].dtype == torch.bfloat16
        assert torch.equal(loaded[h], t)
    c = consumer.counters()
    assert c["load_items"] == 3 and c["load_bytes"] == 3 * 16 * 32 * 2


def test_tensor_parallel_duplicates_upload_once(
    own_server: Server,
    connector: Callable[..., ECCacheConnector],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = ns()
    extra = {"url": own_server.url, "model": model, "dtype": DTYPE}
    h = mm_hash()
    cache = {h: embeds()}
    rank0 = connector(WORKER, extra, tensor_parallel_size=2)
    rank1 = connector(WORKER, extra, tensor_parallel_size=2)
    rank0.save_caches(cache, h)
    monkeypatch.setattr(ec_worker, "_tensor_parallel_rank", lambda: 1)
    rank1.save_caches(cache, h)
    assert rank0.flush(20) and rank1.flush(20)
    assert rank0.counters()["save_created"] == 1
    assert rank1.counters() == {"save_skipped_rank": 1}

    # With every rank saving, first-writer-wins on the server still stores one entry.
    h2 = mm_hash()
    cache2 = {h2: embeds(seed=5)}
    everyone = {**extra, "save_all_ranks": True}
    a = connector(WORKER, everyone, tensor_parallel_size=2)
    b = connector(WORKER, everyone, tensor_parallel_size=2)
    a.save_caches(cache2, h2)
    assert a.flush(20)
    b.save_caches(cache2, h2)
    assert b.flush(20)
    assert a.counters()["save_created"] == 1
    assert b.counters()["save_present"] == 1 and "save_created" not in b.counters()
    assert own_server.stats()["disk"]["entries"] == 2


def test_failed_load_is_recomputed_in_the_same_step(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    model = ns()
    extra = {"url": server.url, "model": model, "dtype": DTYPE, **SYNC}
    kept, lost = mm_hash(), mm_hash()
    put_raw(server, model, kept, embeds(seed=1))
    put_raw(server, model, lost, embeds(seed=2))
    sched = connector(SCHED, extra)
    worker = connector(WORKER, extra)
    req = make_request([kept, lost], req_id="r-lost")
    out, meta = step(sched, [req])
    assert [x.mm_hash for x in meta.loads] == [kept, lost]
    delete_raw(server, model, lost)  # evicted between the answer and the load
    shipped = pickle.loads(pickle.dumps(out))
    worker.bind_connector_metadata(shipped.ec_connector_metadata)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache)
    assert list(cache) == [kept]
    # The item now is part of this step's encoder work, which vLLM's model runner
    # reads from the same SchedulerOutput right after start_load_caches.
    assert shipped.scheduled_encoder_inputs == {"r-lost": [1]}
    c = worker.counters()
    assert c["load_failed"] == 1 and c["load_recomputed"] == 1


def test_vllm_model_runner_encodes_the_recomputed_item(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    """vLLM's own V1 model runner code that picks this step's encoder work out of the
    SchedulerOutput sees the item added by the failed load. (The runner object itself
    needs a GPU; only its ``requests`` table is stood in for, with vLLM's
    ``CachedRequestState``.)"""
    import types

    from vllm.multimodal.inputs import MultiModalKwargsItem
    from vllm.v1.worker.gpu_input_batch import CachedRequestState
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    model = ns()
    extra = {"url": server.url, "model": model, "dtype": DTYPE, **SYNC}
    kept, lost, computed = mm_hash(), mm_hash(), mm_hash()
    put_raw(server, model, kept, embeds(seed=1))
    put_raw(server, model, lost, embeds(seed=2))
    sched, worker = connector(SCHED, extra), connector(WORKER, extra)
    req = make_request([kept, computed, lost], req_id="r-runner")
    out, _ = step(sched, [req])
    delete_raw(server, model, lost)
    shipped = pickle.loads(pickle.dumps(out))
    worker.bind_connector_metadata(shipped.ec_connector_metadata)
    worker.start_load_caches({})
    features = [dataclasses.replace(f, data=MultiModalKwargsItem.dummy()) for f in req.mm_features]
    state = CachedRequestState(
        req_id="r-runner",
        prompt_token_ids=req.prompt_token_ids,
        mm_features=features,
        sampling_params=req.sampling_params,
        generator=None,
        block_ids=([],),
        num_computed_tokens=0,
        output_token_ids=[],
    )
    runner = types.SimpleNamespace(requests={"r-runner": state})
    mm_hashes, _, _ = GPUModelRunner._batch_mm_inputs_from_scheduler(runner, shipped)  # type: ignore[arg-type]
    assert sorted(mm_hashes) == sorted([computed, lost])


def test_failed_load_is_loud_when_it_cannot_be_recomputed(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    model = ns()
    h = mm_hash()
    put_raw(server, model, h, embeds())
    for extra, tp in (
        ({"on_load_failure": "raise"}, 1),
        ({}, 2),  # recomputing on one tensor-parallel rank would desync the ranks
    ):
        full = {"url": server.url, "model": model, "dtype": DTYPE, **SYNC, **extra}
        sched = connector(SCHED, full, tensor_parallel_size=tp)
        worker = connector(WORKER, full, tensor_parallel_size=tp)
        out, _ = step(sched, [make_request([h])])
        # The worker's copy of the metadata names an entry that is not there.
        meta = out.ec_connector_metadata
        assert isinstance(meta, ECCacheConnectorMetadata)
        meta.loads[0].key = "gone-" + h
        worker.bind_connector_metadata(meta)
        with pytest.raises(RuntimeError, match=f"could not load 1 encoder output.*{h}"):
            worker.start_load_caches({})


def test_wrong_shape_is_not_loaded(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    model = ns()
    h = mm_hash()
    put_raw(server, model, h, embeds(rows=8))  # same id, different content size
    extra = {"url": server.url, "model": model, "dtype": DTYPE, **SYNC}
    sched, worker = connector(SCHED, extra), connector(WORKER, extra)
    out, _ = step(sched, [make_request([h], rows=16, req_id="r-shape")])
    assert out.ec_connector_metadata is not None
    worker.bind_connector_metadata(out.ec_connector_metadata)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache)
    assert cache == {} and out.scheduled_encoder_inputs == {"r-shape": [0]}


def test_load_outage_is_bounded(blackhole: str, connector: Callable[..., ECCacheConnector]) -> None:
    from ec_cache.vllm import ECCacheLoad

    worker = connector(
        WORKER,
        {"url": blackhole, "model": ns(), "dtype": DTYPE, "load_timeout_s": 0.5,
         "on_load_failure": "raise"},
    )  # fmt: skip
    loads = [ECCacheLoad(mm_hash(), mm_hash(), 16, None, "r", i) for i in range(4)]
    worker.bind_connector_metadata(ECCacheConnectorMetadata(loads=loads))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="could not load 4"):
        worker.start_load_caches({})
    assert time.monotonic() - t0 < 3.0


def test_slow_cache_drops_instead_of_blocking(
    blackhole: str, connector: Callable[..., ECCacheConnector]
) -> None:
    worker = connector(
        WORKER,
        {"url": blackhole, "model": ns(), "dtype": DTYPE, "save_queue_items": 2,
         "upload_threads": 1, "upload_timeout_s": 0.3},
    )  # fmt: skip
    cache = {mm_hash(): embeds(seed=i) for i in range(6)}
    t0 = time.monotonic()
    for h in cache:
        worker.save_caches(cache, h)
    assert time.monotonic() - t0 < 0.5
    c = worker.counters()
    assert c["save_enqueued"] == 2 and c["save_dropped"] == 4
    assert c["save_dropped_bytes"] == 4 * 16 * 32 * 2


def test_dtype_mismatch_is_not_saved(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    worker = connector(WORKER, {"url": server.url, "model": ns(), "dtype": DTYPE})
    h = mm_hash()
    worker.save_caches({h: torch.zeros(4, 4, dtype=torch.float32)}, h)
    assert worker.counters() == {"save_skipped_dtype": 1}


def test_consumer_only_worker_does_not_save(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    worker = connector(WORKER, {"url": server.url, "model": ns(), "dtype": DTYPE}, "ec_consumer")
    h = mm_hash()
    worker.save_caches({h: embeds()}, h)
    assert worker.flush(5) and worker.counters() == {}


# ------------------------------------------------------------------ shapes


def test_a_consumer_worker_refuses_a_wrong_width(
    server: Server,
    connector: Callable[..., ECCacheConnector],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM measures widths only on EC producers: an ``ec_consumer`` worker learns
    the width from the first output its encoder computes and refuses an entry of the
    right rows but another width, in a synchronous load and in a prefetch alike."""
    model = ns()
    narrow, wide, own = mm_hash(), mm_hash(), mm_hash()
    put_raw(server, model, narrow, embeds(width=16))
    put_raw(server, model, wide, embeds(width=32, seed=1))
    for mode in ("sync", "async"):
        extra = {"url": server.url, "model": model, "dtype": DTYPE, "load_mode": mode,
                 "exists_wait_s": 5}  # fmt: skip
        sched = connector(SCHED, extra, "ec_consumer")
        worker = connector(WORKER, extra, "ec_consumer")
        assert not worker.worker.save_enabled  # type: ignore[union-attr]
        worker.save_caches({own: embeds(width=32, seed=2)}, own)  # computed here
        loop = EngineLoop(sched, [worker], monkeypatch)
        narrow_req = make_request([narrow], req_id=f"r-narrow-{mode}")
        wide_req = make_request([wide], req_id=f"r-wide-{mode}")
        step_ = loop.run_until_scheduled([narrow_req, wide_req])
        # Either refused up front (a failed prefetch: computed) or in the load (then
        # recomputed in the same step): never in the encoder cache.
        assert narrow not in loop.caches[0]
        assert torch.equal(loop.caches[0][wide], embeds(width=32, seed=1))
        if mode == "sync":
            assert worker.counters()["load_recomputed"] == 1
        else:
            assert step_.computed == {f"r-narrow-{mode}": [0]}
            assert worker.counters()["prefetch_fetch_failed"] == 1


def test_the_width_comes_from_the_model_config(
    server: Server, connector: Callable[..., ECCacheConnector], tmp_path: Any
) -> None:
    """Before its encoder computed anything, a worker knows the width from vLLM's
    ModelConfig (here a language model's hidden size of 64)."""

    model_config = tiny_model_config(tmp_path, "bfloat16")
    model = ns()
    narrow, right = mm_hash(), mm_hash()
    put_raw(server, model, narrow, embeds(width=32))
    put_raw(server, model, right, embeds(width=64, seed=1))
    extra = {"url": server.url, "model": model, "dtype": DTYPE, **SYNC}
    sched = connector(SCHED, extra, "ec_consumer", model_config=model_config)
    worker = connector(WORKER, extra, "ec_consumer", model_config=model_config)
    out, _ = step(sched, [make_request([narrow, right], req_id="r-config")])
    worker.bind_connector_metadata(out.ec_connector_metadata)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache)
    assert list(cache) == [right] and out.scheduled_encoder_inputs == {"r-config": [0]}


def test_sync_loads_check_the_width(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    """``load_mode: sync`` on a producer (vLLM measured the width): an entry of the
    right rows and another width is not loaded; only the width check can refuse it."""
    model = ns()
    h = mm_hash()
    put_raw(server, model, h, embeds(rows=16, width=16))
    extra = {"url": server.url, "model": model, "dtype": DTYPE, **SYNC}
    sched = connector(SCHED, extra, widths={"image": 32})
    worker = connector(WORKER, extra, widths={"image": 32})
    out, meta = step(sched, [make_request([h], rows=16, req_id="r-width")])
    assert [(load.num_embeds, load.width) for load in meta.loads] == [(16, 32)]
    worker.bind_connector_metadata(out.ec_connector_metadata)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache)
    assert cache == {} and out.scheduled_encoder_inputs == {"r-width": [0]}
    assert worker.counters()["load_recomputed"] == 1


def test_a_key_whose_prefetch_failed_is_saved_again(
    server: Server,
    connector: Callable[..., ECCacheConnector],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that loaded an entry once knows it present; when a later prefetch of
    it fails (the entry was deleted), the encoder's recomputed output is uploaded
    again instead of being skipped as known for ``hit_ttl_s``."""
    model = ns()
    h = mm_hash()
    put_raw(server, model, h, embeds())
    extra = {"url": server.url, "model": model, "dtype": DTYPE, "exists_wait_s": 5}
    sched, worker = connector(SCHED, extra), connector(WORKER, extra)
    loop = EngineLoop(sched, [worker], monkeypatch)
    loop.run_until_scheduled([make_request([h], req_id="r-first")])
    assert worker.counters()["load_prefetched"] == 1
    delete_raw(server, model, h)
    loop.run([], freed={h})  # vLLM dropped it from its encoder cache
    step_ = loop.run_until_scheduled([make_request([h], req_id="r-again")])
    assert step_.computed == {"r-again": [0]}  # the scheduler still knew it present
    assert worker.counters()["prefetch_fetch_failed"] == 1
    worker.save_caches({h: embeds()}, h)  # what the model runner does once it encoded
    assert worker.flush(30)
    assert "save_skipped_known" not in worker.counters()
    assert worker.counters()["save_created"] == 1
    stored = get_raw(server, model, h)
    assert stored is not None and torch.equal(stored, embeds())


# --------------------------------------------------------- prefetch budget


def test_pooled_staging_returns_its_buffers(server: Server) -> None:
    """The GPU worker's path on the CPU: entries received into pooled staging buffers
    (pinned when CUDA is present), copied out, the buffers reused, the budget kept."""
    model = ns()
    keys = [mm_hash() for _ in range(3)]
    for i, key in enumerate(keys):
        put_raw(server, model, key, embeds(seed=i))
    pool = BufferPool(8 << 20, pinned=False, steps=16)  # (buffers are 1 MiB at least)
    with ec_cache.Client(server.url, model=model, dtype=DTYPE) as client:
        prefetcher = Prefetcher(
            client, dtype=torch.bfloat16, budget_bytes=8 << 20, threads=2, timeout_s=5,
            counters=Counters(), staging=pool,
        )  # fmt: skip
        try:
            for round_ in range(2):
                for i, key in enumerate(keys):
                    prefetcher.submit(PrefetchOrder(10 * round_ + i, key, key, 16, 32))
                wait_for(lambda: len(prefetcher.report().ready) == 3, "three ready", 10, 0.01)
                for i, key in enumerate(keys):
                    entry = prefetcher.take(key, time.monotonic() + 5)
                    assert entry is not None and entry.lease is not None
                    on_device = entry.to_device(torch.device("cpu"))
                    assert entry.lease is None  # back in the pool
                    assert torch.equal(on_device, embeds(seed=i))
                assert prefetcher.held_bytes == 0
            stats = pool.stats()
            assert stats["allocated"] <= 3 and stats["reused"] >= 3
        finally:
            prefetcher.close()


def test_small_entries_stay_within_a_small_budget(server: Server) -> None:
    """The budget bounds the pooled memory really taken (buffer capacities, idle ones
    included), and buffers are reused across sizes: 300 orders of 1 to 12 KiB (a
    buffer is 4 KiB at least) through a 48 KiB budget. (Before: every buffer was 1 MiB
    at least and the budget counted entry bytes: 64 entries of 32 KiB "within" 2 MiB
    held 64 MiB, and 258 of 300 orders allocated a new buffer.)"""
    model = ns()
    rows = [1 + (i * 7) % 12 for i in range(30)]  # 1..12 rows of 512 bfloat16
    keys = [mm_hash() for _ in rows]
    for i, (key, n) in enumerate(zip(keys, rows, strict=True)):
        put_raw(server, model, key, embeds(rows=n, width=512, seed=i))
    budget = 48 << 10
    pool = BufferPool(budget, pinned=False, steps=16, min_capacity=ec_worker.STAGING_MIN_BYTES)
    counters = Counters()
    with ec_cache.Client(server.url, model=model, dtype=DTYPE) as client:
        prefetcher = Prefetcher(
            client, dtype=torch.bfloat16, budget_bytes=budget, threads=4, timeout_s=30,
            counters=counters, staging=pool,
        )  # fmt: skip
        try:
            for round_ in range(10):
                for i, (key, n) in enumerate(zip(keys, rows, strict=True)):
                    prefetcher.submit(PrefetchOrder(100 * round_ + i, key, key, n, 512))
                waits = round_ + 1  # the budget binds: 30 entries need about 200 KiB

                def waited(waits: int = waits) -> bool:
                    return counters.totals().get("prefetch_budget_waits", 0) >= waits

                wait_for(waited, "a prefetch waiting for room", timeout=10, interval=0.01)
                left = set(range(len(keys)))
                while left:  # taken as vLLM would: what is held, one by one
                    held: set[int] = set()

                    def some_held(held: set[int] = held) -> bool:
                        held.update(prefetcher.report().ready)
                        return bool(held)

                    wait_for(some_held, "an entry held", timeout=30, interval=0.005)
                    for i in sorted(order_id - 100 * round_ for order_id in held):
                        entry = prefetcher.take(keys[i], time.monotonic())
                        assert entry is not None
                        on_device = entry.to_device(torch.device("cpu"))
                        assert torch.equal(on_device, embeds(rows=rows[i], width=512, seed=i))
                        stats = pool.stats()
                        assert stats["leased_bytes"] + stats["idle_bytes"] <= budget
                        left.discard(i)
                assert prefetcher.held_bytes == 0
        finally:
            prefetcher.close()
    stats = pool.stats()
    assert counters.totals()["prefetch_fetched"] == 300
    assert stats["peak_bytes"] <= budget
    print(f"\npool after 300 orders: {stats}")  # the figures of the issue note (pytest -s)
    # Sizes spread over 36 size classes, and a full budget drops an idle buffer too
    # small for the next entry now and then (14-23 allocations measured; 258 before).
    assert stats["allocated"] < 50
    assert stats["reused"] >= 300 - stats["allocated"]


def _trickle(body: bytes) -> Callable[[bytes], list[bytes | float]]:
    """A hostile replica: the head of ``body`` at once, then one byte every 0.1 s
    (each socket read gets data long before any read timeout)."""

    def script(head: bytes) -> list[bytes | float]:
        steps: list[bytes | float] = [
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n"
            b"Content-Type: application/octet-stream\r\nX-EC-CRC32C: %08x\r\n"
            b"X-EC-Dtype: bfloat16\r\nX-EC-Shape: 16,32\r\n\r\n" % (len(body), crc32c(body))
        ]
        for i in range(600):
            steps += [body[i : i + 1], 0.1]
        return steps

    return script


def _keys_preferring(client: ec_cache.Client, url: str, n: int) -> list[str]:
    """``n`` keys whose first replica (rendezvous order) is ``url``."""
    keys: list[str] = []
    while len(keys) < n:
        key = mm_hash()
        if client.router.order(client.model, client.dtype, key)[0] == url:
            keys.append(key)
    return keys


def test_a_trickling_replica_does_not_stall_healthy_prefetches(server: Server) -> None:
    """8 entries on a replica that trickles its answers and 4 on a healthy one, 4
    threads: every trickled fetch is given up once its body is below the rate floor
    (not retried), so the healthy entries load within their deadline. (Before: SDK
    timeouts applied per read, the 4 threads stayed on the trickles and 0 of the 4
    healthy entries loaded.)"""
    model = ns()
    hostile = HostileServer(_trickle(body_of(embeds(), "bfloat16")))
    counters = Counters()
    try:
        with ec_cache.Client([server.url, hostile.url], model=model, dtype=DTYPE) as client:
            trickled = _keys_preferring(client, hostile.url, 8)
            healthy = _keys_preferring(client, server.url, 4)
            for i, key in enumerate(healthy):
                put_raw(server, model, key, embeds(seed=i))
            prefetcher = Prefetcher(
                client, dtype=torch.bfloat16, budget_bytes=1 << 20, threads=4,
                timeout_s=20, counters=counters, min_rate=1 << 20,
            )  # fmt: skip
            try:
                orders = [PrefetchOrder(i, k, k, 16, 32) for i, k in enumerate(trickled + healthy)]
                for order in orders:
                    prefetcher.submit(order)
                ready: set[int] = set()
                failed: set[int] = set()

                def settled() -> bool:
                    report = prefetcher.report()
                    ready.update(report.ready)
                    failed.update(report.failed)
                    return len(ready) + len(failed) == len(orders)

                wait_for(settled, "every prefetch held or failed", timeout=20, interval=0.02)
                assert ready == {8, 9, 10, 11} and failed == set(range(8))
                for i, key in enumerate(healthy):
                    entry = prefetcher.take(key, time.monotonic())
                    assert entry is not None and torch.equal(entry.tensor, embeds(seed=i))
                assert "load_retries" not in counters.totals()  # a slow body is final
            finally:
                prefetcher.close()
    finally:
        hostile.close()


def test_a_released_fetch_frees_its_slot_and_bytes_at_once(server: Server) -> None:
    """One thread, a fetch trickling in (no rate floor, a 60 s deadline): releasing
    it frees its bytes before ``release`` returns, and its thread for the next order
    (which loads from the healthy replica) once the SDK saw ``stop``; the trickle's
    connection is closed. (Before: the job was only marked, its bytes stayed
    reserved and the next order waited behind it.)"""
    model = ns()
    hostile = HostileServer(_trickle(body_of(embeds(), "bfloat16")))
    counters = Counters()
    try:
        with ec_cache.Client([server.url, hostile.url], model=model, dtype=DTYPE) as client:
            (slow,) = _keys_preferring(client, hostile.url, 1)
            (fast,) = _keys_preferring(client, server.url, 1)
            put_raw(server, model, fast, embeds(seed=3))
            prefetcher = Prefetcher(
                client, dtype=torch.bfloat16, budget_bytes=1 << 20, threads=1,
                timeout_s=60, counters=counters,
            )  # fmt: skip
            try:
                prefetcher.submit(PrefetchOrder(1, slow, slow, 16, 32))
                wait_for(lambda: len(hostile.requests) == 1, "the trickled GET", timeout=10)
                assert prefetcher.held_bytes == BYTES  # reserved by the fetch in flight
                prefetcher.release(1)
                assert prefetcher.held_bytes == 0
                assert prefetcher.report() == PrefetchReport(frozenset(), frozenset(), 0)
                prefetcher.submit(PrefetchOrder(2, fast, fast, 16, 32))
                wait_for(lambda: prefetcher.report().ready == {2}, "the next order", timeout=10)
                entry = prefetcher.take(fast, time.monotonic())
                assert entry is not None and torch.equal(entry.tensor, embeds(seed=3))
                wait_for(lambda: hostile.closed_connections == 1, "the trickle abandoned")
                assert counters.totals()["prefetch_dropped"] == 1
                assert "prefetch_fetch_failed" not in counters.totals()
            finally:
                prefetcher.close()
    finally:
        hostile.close()
