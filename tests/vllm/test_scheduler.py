"""The connector's scheduler role (``ec_cache._vllm.scheduler``) through
``ECCacheConnector`` built by vLLM 0.33's factory for ``SCHEDULER``, against a real
ec-cache server: existence answers, their caches, the breaker, the step's metadata."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="tests/vllm run in .venv-vllm (scripts/setup-vllm-venv.sh)")

import pickle
import time
from collections.abc import Callable
from typing import Any

from conftest import Server
from ec_cache._vllm.keys import cache_key
from ec_cache.vllm import ECCacheConnector, ECCacheConnectorMetadata
from helpers import (
    DTYPE,
    SCHED,
    SYNC,
    breaker_of,
    embeds,
    make_request,
    mm_hash,
    ns,
    put_raw,
    step,
)
from vllm.v1.core.sched.output import SchedulerOutput


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

    # Next step: positives come from the local LRU; the miss is still cached too
    # (miss_ttl_s, 1 s by default), so nothing is asked again.
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
        assert breaker_of(sched).state == "open"


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
    assert breaker_of(sched).state == "open"
    sched.build_connector_meta(SchedulerOutput.make_empty())
    assert sched.has_cache_item(h) is False  # cooling down: no network
    assert sched.counters()["exists_requests"] == 1
    srv = start_server(tmp_path, port=port)
    try:
        put_raw(srv, model, h, embeds())
        # The behaviour under test: the breaker's 0.5 s cooldown running out.
        time.sleep(max(0.0, opened + 0.6 - time.monotonic()))
        sched.build_connector_meta(SchedulerOutput.make_empty())
        req = make_request([h])
        sched.ensure_cache_available(req, 0)  # the probe
        assert sched.has_cache_item(h) is True
        assert breaker_of(sched).state == "closed"
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
