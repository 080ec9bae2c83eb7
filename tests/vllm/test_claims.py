"""Encode once per cluster, at the class level: two engines (each a scheduler connector
and a worker connector driven as vLLM 0.33 drives them) meet the same new image at one
real ec-cache server. The first claims it and encodes; the second defers the request
until the entry lands and then loads it, or computes it when the claim ends without an
entry or its wait runs out."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="tests/vllm run in .venv-vllm (scripts/setup-vllm-venv.sh)")

from collections.abc import Callable
from typing import Any

import httpx
import torch
from conftest import Server
from ec_cache._vllm.keys import cache_key
from ec_cache.vllm import ECCacheConnector
from engine_loop import EngineLoop
from helpers import DTYPE, SCHED, WORKER, embeds, make_request, mm_hash, ns
from vllm.v1.request import Request

from testkit.polling import wait_for

WAIT = {"exists_wait_s": 5}  # each step waits for the question's answer (not its wait)


def engine(
    connector: Callable[..., ECCacheConnector],
    monkeypatch: pytest.MonkeyPatch,
    extra: dict[str, Any],
    role: str = "ec_both",
) -> EngineLoop:
    return EngineLoop(
        connector(SCHED, extra, ec_role=role), [connector(WORKER, extra, ec_role=role)], monkeypatch
    )


def defer_until(loop: EngineLoop, request: Request, counter: str) -> None:
    """Step ``loop`` (``request`` deferred all along) until ``counter`` counts one."""

    def stepped() -> bool:
        assert loop.run([request]).deferred == [request.request_id]
        return bool(loop.sched.counters().get(counter, 0) >= 1)

    wait_for(stepped, f"{counter} on {request.request_id}")


def claim_state(server: Server, model: str, identifier: str) -> str:
    answer = httpx.post(
        f"{server.url}/ec/{model}/{DTYPE}/_exists",
        json={"hashes": [cache_key(identifier)], "claims": True},
    )
    state: str = answer.json()["state"][0]
    return state


def test_the_second_engine_waits_for_the_first_and_loads_its_output(
    server: Server, connector: Callable[..., ECCacheConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, h = ns(), mm_hash()
    extra = {"url": server.url, "model": model, "dtype": DTYPE, **WAIT}
    first, second = engine(connector, monkeypatch, extra), engine(connector, monkeypatch, extra)
    req_a, req_b = make_request([h], req_id="a"), make_request([h], req_id="b")

    assert first.run_until_scheduled([req_a]).computed == {"a": [0]}
    assert first.sched.counters()["claims_granted"] == 1
    assert claim_state(server, model, h) == "computing"
    defer_until(second, req_b, "claims_contended")
    assert "claims_granted" not in second.sched.counters()

    # The first engine's encoder output is uploaded by its worker: the claim ends.
    output = embeds(seed=4)
    first.workers[0].save_caches({h: output}, h)
    assert first.workers[0].flush(timeout=30)
    step = second.run_until_scheduled([req_b])
    assert step.computed == {}  # loaded, not encoded
    assert torch.equal(second.caches[0][h], output)
    c = second.sched.counters()
    assert c["claims_landed"] == 1 and c["hits"] == 1
    assert "claims_computed_after_wait" not in c


def test_a_claimer_that_never_uploads_costs_the_other_engine_its_lease(
    server: Server, connector: Callable[..., ECCacheConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, h = ns(), mm_hash()
    extra = {"url": server.url, "model": model, "dtype": DTYPE, **WAIT}
    crashed = engine(connector, monkeypatch, {**extra, "claim_lease_s": 0.5})
    survivor = engine(connector, monkeypatch, extra)
    req_a, req_b = make_request([h], req_id="a"), make_request([h], req_id="b")
    assert crashed.run_until_scheduled([req_a]).computed == {"a": [0]}
    # ... and dies before its upload. The other engine waits out the lease, then encodes.
    step = survivor.run_until_scheduled([req_b])
    assert step.computed == {"b": [0]}
    c = survivor.sched.counters()
    assert c["claims_contended"] == 1 and c["claims_computed_after_wait"] == 1
    assert "claims_landed" not in c


def test_a_wait_ends_at_claim_wait_s_and_the_engine_computes(
    server: Server, connector: Callable[..., ECCacheConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, h = ns(), mm_hash()
    extra = {"url": server.url, "model": model, "dtype": DTYPE, **WAIT}
    slow = engine(connector, monkeypatch, {**extra, "claim_lease_s": 60})
    impatient = engine(connector, monkeypatch, {**extra, "claim_wait_s": 0.3})
    req_a, req_b = make_request([h], req_id="a"), make_request([h], req_id="b")
    slow.run_until_scheduled([req_a])
    assert impatient.run_until_scheduled([req_b]).computed == {"b": [0]}
    assert impatient.sched.counters()["claims_computed_after_wait"] == 1
    assert claim_state(server, model, h) == "computing"  # the slow engine's claim lives on


def test_an_engine_that_does_not_save_waits_but_never_claims(
    server: Server, connector: Callable[..., ECCacheConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, h, other = ns(), mm_hash(), mm_hash()
    extra = {"url": server.url, "model": model, "dtype": DTYPE, **WAIT}
    producer = engine(connector, monkeypatch, extra)
    consumer = engine(connector, monkeypatch, extra, role="ec_consumer")
    req_a, req_b = make_request([h], req_id="a"), make_request([h], req_id="b")
    req_c = make_request([other], req_id="c")
    producer.run_until_scheduled([req_a])
    assert consumer.run_until_scheduled([req_c]).computed == {"c": [0]}
    assert claim_state(server, model, other) == "absent"  # asked, not claimed
    defer_until(consumer, req_b, "claims_contended")
    output = embeds(seed=5)
    producer.workers[0].save_caches({h: output}, h)
    assert producer.workers[0].flush(timeout=30)
    assert consumer.run_until_scheduled([req_b]).computed == {}
    assert torch.equal(consumer.caches[0][h], output)
    c = consumer.sched.counters()
    assert c["claims_landed"] == 1 and "claims_granted" not in c


def test_a_request_this_engine_encodes_anyway_does_not_wait_for_others(
    server: Server, connector: Callable[..., ECCacheConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines that each claimed an item of the same request must not wait for
    each other until a lease ends: a request with an item to encode here runs now."""
    model, theirs, mine = ns(), mm_hash(), mm_hash()
    extra = {"url": server.url, "model": model, "dtype": DTYPE, **WAIT}
    other, this = engine(connector, monkeypatch, extra), engine(connector, monkeypatch, extra)
    req_a, req_b = make_request([theirs], req_id="a"), make_request([theirs, mine], req_id="b")
    other.run_until_scheduled([req_a])
    assert this.run_until_scheduled([req_b]).computed == {"b": [0, 1]}
    c = this.sched.counters()
    assert c["claims_granted"] == 1 and c["claims_contended"] == 1
    assert c["claims_computed_after_wait"] == 1
    assert claim_state(server, model, mine) == "computing"  # its own claim, until its upload
