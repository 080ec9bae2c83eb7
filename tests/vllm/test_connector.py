"""ECCacheConnector against vLLM 0.33's own classes and a real ec-cache server.

Nothing is mocked between vLLM and the connector or between the connector and the
server: configs come from vLLM's CLI parser type, the connector from vLLM's factory,
requests and scheduler outputs are vLLM's classes, the server is ``python -m app``.
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

import ec_cache.vllm as ecv
import torch
from conftest import Server
from ec_cache._vllm.keys import cache_key
from ec_cache.vllm import ECCacheConnector, ECCacheConnectorMetadata
from helpers import (
    DTYPE,
    SCHED,
    WORKER,
    delete_raw,
    embeds,
    get_raw,
    make_request,
    mm_hash,
    ns,
    put_raw,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

# The synchronous load path of this module's tests; the scheduler waits for each
# existence answer (the asynchronous path: test_async_loads.py).
SYNC = {"load_mode": "sync", "exists_wait_s": 5}


def step(sched: ECCacheConnector, requests: list[Request]) -> tuple[SchedulerOutput, Any]:
    """What vLLM's scheduler does with the connector in one step: ask, allocate the
    items it answered present for (and the computed ones), build the metadata."""
    out = SchedulerOutput.make_empty()
    for req in requests:
        sched.ensure_cache_available(req, req.num_computed_tokens)
        computed = []
        for i, feature in enumerate(req.mm_features):
            if not sched.has_cache_item(feature.identifier):
                computed.append(i)
            sched.update_state_after_alloc(req, i)
        if computed:
            out.scheduled_encoder_inputs[req.request_id] = computed
    meta = sched.build_connector_meta(out)
    out.ec_connector_metadata = meta
    return out, meta


# ------------------------------------------------------------------- factory


def test_factory_builds_connector_from_cli_json(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    model = ns()
    extra = {"url": server.url, "model": model, "dtype": DTYPE}
    for role in (SCHED, WORKER):
        conn = connector(role, extra)
        assert type(conn).__module__ == "ec_cache.vllm"
        assert conn.role is role
        assert (conn.model, conn.dtype) == (model, DTYPE)
        assert conn.is_producer and conn.is_consumer


def test_encoder_revision_and_bad_settings(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    conn = connector(
        SCHED,
        {"url": server.url, "model": "Qwen/Qwen2.5-VL-7B-Instruct", "dtype": DTYPE,
         "encoder_revision": "a1b2c3"},
    )  # fmt: skip
    assert conn.model == "Qwen/Qwen2.5-VL-7B-Instruct@a1b2c3"
    with pytest.raises(ValueError, match="unknown key"):
        connector(SCHED, {"url": server.url, "model": "m", "dtype": DTYPE, "exist_timeout": 1})
    with pytest.raises(ValueError, match="not a valid ec-cache model namespace"):
        connector(SCHED, {"url": server.url, "model": "/models/x", "dtype": DTYPE})
    with pytest.raises(ValueError, match="needs the server"):
        connector(SCHED, {"model": "m", "dtype": DTYPE})


def test_namespace_from_vllm_model_config(
    server: Server, connector: Callable[..., ECCacheConnector], tmp_path: Any
) -> None:
    """dtype comes from vLLM's ModelConfig; a local model path is refused as a
    namespace until ``model`` is set."""
    import json

    from vllm.config import ModelConfig

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_hidden_layers": 1, "num_key_value_heads": 4, "vocab_size": 1000,
                "max_position_embeddings": 512, "torch_dtype": "float16",
            }
        )
    )  # fmt: skip
    model_config = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="auto")
    with pytest.raises(ValueError, match=r"set ec_connector_extra_config\.model"):
        connector(SCHED, {"url": server.url}, model_config=model_config)
    conn = connector(SCHED, {"url": server.url, "model": "org/tiny"}, model_config=model_config)
    assert (conn.model, conn.dtype) == ("org/tiny", "float16")


# ------------------------------------------------------------------ scheduler


def test_has_cache_item_hit_and_miss(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    model = ns()
    present, absent = mm_hash(), mm_hash()
    lora_id = f"my-adapter:{present}"
    odd_id = "user image #7 / ünïcode"  # a user-supplied UUID that is not wire-safe
    put_raw(server, model, present, embeds())
    put_raw(server, model, lora_id, embeds())
    put_raw(server, model, cache_key(odd_id), embeds())
    sched = connector(SCHED, {"url": server.url, "model": model, "dtype": DTYPE})
    assert sched.has_cache_item(present) is True
    assert sched.has_cache_item(absent) is False
    assert sched.has_cache_item(lora_id) is True
    assert sched.has_cache_item(f"other-adapter:{present}") is False  # LoRA namespaces
    assert sched.has_cache_item(odd_id) is True
    c = sched.counters()
    assert c["hits"] == 3 and c["misses"] == 2
    assert c["exists_requests"] == 5  # no batching hook used: one question each


def test_one_round_trip_per_request_and_local_positives(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    model = ns()
    a, b, c_ = mm_hash(), mm_hash(), mm_hash()
    put_raw(server, model, a, embeds())
    put_raw(server, model, b, embeds())
    sched = connector(SCHED, {"url": server.url, "model": model, "dtype": DTYPE, **SYNC})
    req = make_request([a, b, c_])
    # vLLM calls ensure_cache_available before the per-item questions.
    assert sched.ensure_cache_available(req, 0) is True
    assert [sched.has_cache_item(i) for i in (a, b, c_)] == [True, True, False]
    assert sched.counters()["exists_requests"] == 1
    sched.build_connector_meta(SchedulerOutput.make_empty())  # end of step

    # Next step: positives come from the local LRU, the miss is asked again.
    time.sleep(0)  # (miss_ttl_s default 1 s: the miss is still cached too)
    assert sched.ensure_cache_available(req, 0) is True
    assert [sched.has_cache_item(i) for i in (a, b, c_)] == [True, True, False]
    totals = sched.counters()
    assert totals["exists_requests"] == 1
    assert totals["hits_local"] == 2

    # Items already consumed by the prefill are not asked about.
    fresh = connector(SCHED, {"url": server.url, "model": model, "dtype": DTYPE, **SYNC})
    consumed = req.mm_features[1].mm_position
    fresh.ensure_cache_available(req, consumed.offset + consumed.length)
    assert fresh.counters()["exists_requests"] == 1
    assert fresh.has_cache_item(c_) is False  # answered by that batch
    assert fresh.counters()["exists_requests"] == 1


def test_outage_answers_miss_within_the_time_bound(
    blackhole: str, dead_url: str, connector: Callable[..., ECCacheConnector]
) -> None:
    for url in (blackhole, dead_url):
        sched = connector(
            SCHED,
            {"url": url, "model": ns(), "dtype": DTYPE, "exists_timeout_s": 0.1,
             "breaker_failures": 2, "breaker_cooldown_s": 30},
        )  # fmt: skip
        times = []
        for _ in range(6):
            t0 = time.monotonic()
            assert sched.has_cache_item(mm_hash()) is False
            times.append(time.monotonic() - t0)
        # Each network try is bounded (connect + send + read timeouts of 0.1 s)...
        assert max(times) < 1.0, times
        # ...and after 2 failures the breaker answers without the network.
        assert max(times[2:]) < 0.01, times
        c = sched.counters()
        assert c["exists_failed"] == 2
        assert c["misses_outage"] == 6
        assert sched._breaker.state == "open"


def test_breaker_probes_and_recovers(
    tmp_path: Any, connector: Callable[..., ECCacheConnector]
) -> None:
    from conftest import start_server

    from testkit.ports import free_port

    port = free_port()
    model = ns()
    sched = connector(
        SCHED,
        {"url": f"http://127.0.0.1:{port}", "model": model, "dtype": DTYPE,
         "breaker_failures": 1, "breaker_cooldown_s": 0.5, **SYNC},
    )  # fmt: skip
    h = mm_hash()
    assert sched.has_cache_item(h) is False  # nothing listens: the breaker opens
    opened = time.monotonic()
    assert sched._breaker.state == "open"
    sched.build_connector_meta(SchedulerOutput.make_empty())
    assert sched.has_cache_item(h) is False  # cooling down: no network
    assert sched.counters()["exists_requests"] == 1
    srv = start_server(tmp_path, port=port)
    try:
        put_raw(srv, model, h, embeds())
        time.sleep(max(0.0, opened + 0.6 - time.monotonic()))
        sched.build_connector_meta(SchedulerOutput.make_empty())
        req = make_request([h])
        sched.ensure_cache_available(req, 0)  # the probe
        assert sched.has_cache_item(h) is True
        assert sched._breaker.state == "closed"
        assert sched.counters()["exists_requests"] == 2
    finally:
        srv.stop()


def test_server_death_stops_local_positives(
    own_server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    model = ns()
    h = mm_hash()
    put_raw(own_server, model, h, embeds())
    sched = connector(
        SCHED,
        {"url": own_server.url, "model": model, "dtype": DTYPE, "breaker_failures": 1,
         "breaker_cooldown_s": 30},
    )  # fmt: skip
    assert sched.has_cache_item(h) is True
    sched.build_connector_meta(SchedulerOutput.make_empty())
    own_server.stop()
    # Still in the LRU, but a load would fail: once the server is known to be down,
    # the scheduler promises nothing.
    assert sched.has_cache_item(mm_hash()) is False  # fails, opens the breaker
    sched.build_connector_meta(SchedulerOutput.make_empty())
    t0 = time.monotonic()
    assert sched.has_cache_item(h) is False
    assert time.monotonic() - t0 < 0.01


def test_build_connector_meta_carries_the_loads(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    model = ns()
    hit, miss = mm_hash(), mm_hash()
    put_raw(server, model, hit, embeds(rows=16))
    sched = connector(SCHED, {"url": server.url, "model": model, "dtype": DTYPE, **SYNC})
    req = make_request([miss, hit], rows=16, req_id="r-meta")
    out, meta = step(sched, [req])
    assert isinstance(meta, ECCacheConnectorMetadata)
    assert [(x.mm_hash, x.num_embeds, x.req_id, x.input_id) for x in meta.loads] == [
        (hit, 16, "r-meta", 1)
    ]
    assert out.scheduled_encoder_inputs == {"r-meta": [0]}
    assert meta.scheduled_encoder_inputs is out.scheduled_encoder_inputs
    # Shipped to a worker process (pickled, as vLLM's executors do), the metadata
    # still points at that step's encoder inputs.
    shipped = pickle.loads(pickle.dumps(out))
    assert (
        shipped.ec_connector_metadata.scheduled_encoder_inputs is shipped.scheduled_encoder_inputs
    )
    # The state is reset for the next step.
    empty = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert isinstance(empty, ECCacheConnectorMetadata) and empty.loads == []


# --------------------------------------------------------------------- worker


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
    monkeypatch.setattr(ecv, "_tensor_parallel_rank", lambda: 1)
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


def test_request_scoped_names_are_never_cached(
    server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    """vLLM with both its multimodal processor cache and prefix caching off names items
    ``renderer0-mm-{n}-image-{i}`` (by request, counted from 1 by every fresh server):
    even an entry stored under such a name (another image, another server) is never
    loaded, and such items are neither asked about nor saved."""
    model = ns()
    scoped = "renderer0-mm-1-image-0"
    put_raw(server, model, scoped, embeds())
    sched = connector(SCHED, {"url": server.url, "model": model, "dtype": DTYPE})
    req = make_request([scoped])
    assert sched.ensure_cache_available(req, 0) is True  # never deferred for it
    assert sched.has_cache_item(scoped) is False
    assert sched.counters() == {"misses_request_scoped": 1}  # no exists request made
    worker = connector(WORKER, {"url": server.url, "model": model, "dtype": DTYPE})
    worker.save_caches({scoped: embeds()}, scoped)
    assert worker.flush(5) and worker.counters() == {"save_skipped_request_scoped": 1}
    # A content hash or a user's own id of a similar look is cached as usual.
    assert sched.has_cache_item("renderer0-mm-1-image-0x") is False
    assert sched.counters()["exists_requests"] == 1


# ---------------------------------------------------------------------- stats


def test_stats_through_vllm_hooks(
    server: Server,
    connector: Callable[..., ECCacheConnector],
    make_vllm_config: Callable[..., Any],
) -> None:
    from prometheus_client import REGISTRY
    from vllm.distributed.ec_transfer.ec_connector.metrics import (
        ECConnectorLogging,
        ECConnectorProm,
    )

    model = ns()
    extra = {"url": server.url, "model": model, "dtype": DTYPE}
    h = mm_hash()
    put_raw(server, model, h, embeds())
    sched = connector(SCHED, extra)
    sched.has_cache_item(h)
    sched.has_cache_item(mm_hash())
    stats = sched.get_ec_connector_stats()
    assert stats is not None and not stats.is_empty()
    assert sched.get_ec_connector_stats() is None  # per interval
    worker_stats = type(stats)(data={"hits": 1, "load_items": 2})
    merged = worker_stats.aggregate(stats)  # what vLLM's scheduler does
    reduced = merged.reduce()
    assert reduced["hits"] == 2 and reduced["misses"] == 1 and reduced["hit_rate"] == 0.6667
    assert "exists_avg_ms" in reduced
    # Prefetch figures of two later steps: counters add up, the gauge is the latest.
    steps = [
        {"deferred_requests": 1, "deferred_seconds": 0.2, "prefetch_started": 1,
         "prefetch_bytes_held": 4096},
        {"deferred_requests": 1, "deferred_seconds": 0.4, "prefetch_ready": 1,
         "prefetch_bytes_held": 1024},
    ]  # fmt: skip
    for data in steps:
        merged = merged.aggregate(type(stats)(data=data))
    reduced = merged.reduce()
    assert reduced["deferred_requests"] == 2 and reduced["deferred_avg_ms"] == 300.0
    assert reduced["prefetch_bytes_held"] == 1024 and "deferred_seconds" not in reduced

    config = make_vllm_config(extra)
    logging_ = ECConnectorLogging(config.ec_transfer_config)
    logging_.observe(merged.data)
    lines: list[str] = []
    logging_.log(lambda fmt, *args: lines.append(fmt % args))  # type: ignore[no-untyped-call]
    assert lines and "hit_rate=0.6667" in lines[0] and "deferred_avg_ms=300.0" in lines[0]

    prom = ECConnectorProm(config, ["engine"], {0: ["0"]})
    prom.observe(merged.data, 0)
    labels = {"engine": "0"}
    assert REGISTRY.get_sample_value("vllm:ec_cache_hits_total", labels) == 2
    assert REGISTRY.get_sample_value("vllm:ec_cache_deferred_requests_total", labels) == 2
    assert REGISTRY.get_sample_value("vllm:ec_cache_prefetch_started_total", labels) == 1
    assert REGISTRY.get_sample_value("vllm:ec_cache_prefetch_bytes_held", labels) == 1024


# ---------------------------------------------------------- replicas and auth


def _save_then_load_all(
    urls: list[str], connector: Callable[..., ECCacheConnector], n: int = 12
) -> tuple[str, dict[str, torch.Tensor], ECCacheConnector, dict[str, torch.Tensor]]:
    model = ns()
    extra = {"urls": urls, "model": model, "dtype": DTYPE, **SYNC}
    worker = connector(WORKER, extra)
    outputs = {mm_hash(): embeds(seed=i) for i in range(n)}
    for h in outputs:
        worker.save_caches(outputs, h)
    assert worker.flush(30)
    assert worker.counters()["save_created"] == n
    sched, consumer = connector(SCHED, extra), connector(WORKER, extra)
    out, _ = step(sched, [make_request(list(outputs))])
    consumer.bind_connector_metadata(pickle.loads(pickle.dumps(out)).ec_connector_metadata)
    loaded: dict[str, torch.Tensor] = {}
    consumer.start_load_caches(loaded)
    return model, outputs, sched, loaded


def test_replicas_spread_keys(
    server: Server, own_server: Server, connector: Callable[..., ECCacheConnector]
) -> None:
    model, outputs, sched, loaded = _save_then_load_all([server.url, own_server.url], connector)
    on_shared = [get_raw(server, model, h) is not None for h in outputs]
    on_own = [get_raw(own_server, model, h) is not None for h in outputs]
    assert all(a != b for a, b in zip(on_shared, on_own, strict=True))  # each entry once
    assert any(on_shared) and any(on_own)  # spread over both
    assert sched.counters()["exists_requests"] == 1  # (one _exists per replica inside)
    assert loaded.keys() == outputs.keys()
    assert all(torch.equal(loaded[h], t) for h, t in outputs.items())


def test_a_dead_replica_fails_over(
    server: Server, dead_url: str, connector: Callable[..., ECCacheConnector]
) -> None:
    model, outputs, sched, loaded = _save_then_load_all([server.url, dead_url], connector)
    assert all(get_raw(server, model, h) is not None for h in outputs)
    assert sched.counters()["hits"] == len(outputs)
    assert all(torch.equal(loaded[h], t) for h, t in outputs.items())


def test_a_dead_replica_among_three_fails_over(
    server: Server,
    own_server: Server,
    dead_url: str,
    connector: Callable[..., ECCacheConnector],
) -> None:
    _, outputs, sched, loaded = _save_then_load_all(
        [server.url, own_server.url, dead_url], connector, n=24
    )
    assert sched.counters()["hits"] == len(outputs)
    assert loaded.keys() == outputs.keys()


def test_token_is_sent_and_a_bad_one_is_a_miss(
    tmp_path: Any, connector: Callable[..., ECCacheConnector]
) -> None:
    from conftest import start_server

    srv = start_server(tmp_path, {"EC_AUTH_TOKENS": "vllm:read,write:s3cret-token-0123456789"})
    try:
        model = ns()
        good = {"url": srv.url, "model": model, "dtype": DTYPE, "token": "s3cret-token-0123456789"}
        h = mm_hash()
        worker = connector(WORKER, good)
        worker.save_caches({h: embeds()}, h)
        assert worker.flush(20) and worker.counters()["save_created"] == 1
        assert connector(SCHED, good).has_cache_item(h) is True
        bad = connector(SCHED, {**good, "token": "wrong"})
        assert bad.has_cache_item(h) is False
        assert bad.counters()["exists_failed"] == 1
        assert bad.counters()["misses_outage"] == 1
    finally:
        srv.stop()
