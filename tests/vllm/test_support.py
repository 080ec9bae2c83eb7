"""The connector's building blocks (no server): keys, caches, breaker, uploader, and
the parsing of ``ec_connector_extra_config``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="tests/vllm run in .venv-vllm (scripts/setup-vllm-venv.sh)")

import threading
import time
from typing import Any

import torch
from ec_cache._vllm.breaker import CircuitBreaker
from ec_cache._vllm.counters import Counters
from ec_cache._vllm.keys import cache_key
from ec_cache._vllm.planner import REPORT_GRACE_S, PrefetchPlanner, PrefetchStatus
from ec_cache._vllm.ttl_cache import TTLCache
from ec_cache._vllm.uploader import BackgroundUploader, UploadJob
from ec_cache.vllm import ECCacheConnectorStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_cache_key_keeps_vllm_ids_and_hashes_the_rest() -> None:
    blake = "a" * 64
    assert cache_key(blake) == blake
    assert cache_key(f"my-lora:{blake}") == f"my-lora:{blake}"
    assert cache_key("req-1-image-0") == "req-1-image-0"
    assert cache_key("123e4567-e89b-12d3-a456-426614174000").startswith("123e4567")
    for odd in ("org/lora:" + blake, "x" * 257, "ünï", "a b"):
        key = cache_key(odd)
        assert key.startswith("sha256:") and len(key) == 71
        assert cache_key(odd) == key  # deterministic across workers
    assert cache_key("a b") != cache_key("a  b")


def test_ttl_cache_bounds_and_expiry() -> None:
    clock = Clock()
    cache: TTLCache[str, bool] = TTLCache(2, ttl=10.0, clock=clock)
    cache.put("a", True)
    cache.put("b", True)
    assert cache.get("a")  # refreshes "a"
    cache.put("c", True)  # evicts the least recently used: "b"
    assert cache.get("b") is None and cache.get("a") and cache.get("c")
    clock.now += 10.0
    assert cache.get("a") is None and cache.get("c") is None  # every entry expired
    cache.put("d", True)
    cache.discard("d")
    assert cache.get("d") is None
    forever: TTLCache[str, bool] = TTLCache(1, clock=clock)  # no ttl: kept until evicted
    forever.put("x", True)
    clock.now += 1e9
    assert forever.get("x")
    disabled: TTLCache[str, bool] = TTLCache(0)
    disabled.put("x", True)
    assert disabled.get("x") is None


def test_breaker_opens_backs_off_and_probes_once() -> None:
    clock = Clock()
    breaker = CircuitBreaker(2, cooldown=1.0, max_cooldown=3.0, clock=clock)
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state == "closed" and breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow() and not breaker.healthy
    clock.now += 1.0
    assert breaker.state == "half-open"
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one
    breaker.record_failure()  # probe failed: 2 s now
    clock.now += 1.5
    assert not breaker.allow()
    clock.now += 0.5
    assert breaker.allow()
    breaker.record_failure()  # 4 s, capped at 3 s
    clock.now += 3.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.healthy and breaker.opened == 3


def test_uploader_bounds_and_counts() -> None:
    gate = threading.Event()
    seen: list[str] = []

    def put(key: str, tensor: Any) -> bool:
        gate.wait(5)
        seen.append(key)
        if key == "boom":
            raise OSError("refused")
        return key != "dup"

    counters = Counters()
    up = BackgroundUploader(put, counters=counters, max_items=3, max_bytes=100, threads=1)
    t = torch.zeros(1)
    assert up.submit(UploadJob("a", t, 10))
    assert up.submit(UploadJob("dup", t, 10))
    assert up.submit(UploadJob("boom", t, 10))
    assert not up.submit(UploadJob("d", t, 10))  # 3 items pending
    gate.set()
    assert up.flush(5)
    assert up.submit(UploadJob("e", t, 60))
    assert up.flush(5)
    readied: list[int] = []
    assert up.submit(UploadJob("f", t, 10, ready=lambda: readied.append(1)))
    assert up.flush(5) and readied == [1]
    # One job may exceed max_bytes only when nothing else is pending.
    gate.clear()
    assert up.submit(UploadJob("g", t, 90))
    assert not up.submit(UploadJob("h", t, 20))
    gate.set()
    up.close(5)
    assert not up.submit(UploadJob("i", t, 1))
    c = counters.totals()
    assert seen == ["a", "dup", "boom", "e", "f", "g"]
    assert c["save_created"] == 4 and c["save_present"] == 1 and c["save_failed"] == 1
    assert c["save_dropped"] == 3 and c["save_bytes"] == 170


def test_uploader_close_drops_what_is_left() -> None:
    counters = Counters()
    release = threading.Event()
    up = BackgroundUploader(
        lambda k, t: release.wait(5), counters=counters, max_items=10, threads=1
    )
    for i in range(4):
        up.submit(UploadJob(str(i), None, 5))
    t0 = time.monotonic()
    up.close(timeout=0.2)
    assert time.monotonic() - t0 < 2
    release.set()
    assert counters.totals()["save_dropped"] == 3  # the one in flight finishes


def test_stats_reduce_and_aggregate() -> None:
    a = ECCacheConnectorStats(data={"hits": 3, "misses": 1, "exists_requests": 2,
                                    "exists_seconds": 0.004})  # fmt: skip
    b = ECCacheConnectorStats(data={"load_items": 3, "load_steps": 1, "load_seconds": 0.5})
    merged = a.aggregate(b)
    out = merged.reduce()
    assert out["hit_rate"] == 0.75 and out["exists_avg_ms"] == 2.0
    assert out["load_avg_ms"] == 500.0 and "load_seconds" not in out
    assert not merged.is_empty()
    merged.reset()  # type: ignore[no-untyped-call]  # vLLM's method, unannotated
    assert merged.is_empty()


def test_planner_ships_orders_and_ignores_stale_reports() -> None:
    clock = Clock()
    counters = Counters()
    planner = PrefetchPlanner(timeout_s=2.0, counters=counters, clock=clock)
    assert planner.need("r1", "x", "x", 16, None) is PrefetchStatus.ORDERED
    assert planner.need("r2", "x", "x", 16, None) is PrefetchStatus.ORDERED  # one order
    orders, releases, expired = planner.end_step(True)
    assert [o.order_id for o in orders] == [1] and releases == [] and expired == set()
    assert planner.status("x") is PrefetchStatus.SHIPPED
    planner.drop_request("r1")
    planner.drop_request("r2")  # nobody waits any more: released
    assert planner.status("x") is None
    assert planner.need("r3", "x", "x", 16, None) is PrefetchStatus.ORDERED
    orders, releases, _ = planner.end_step(True)
    assert [o.order_id for o in orders] == [2] and releases == [1]
    # A late report about the released order does not make the new one ready.
    planner.on_report(ready={1}, failed=set(), held_bytes=10)
    assert planner.status("x") is PrefetchStatus.SHIPPED
    planner.on_report(ready={2}, failed=set(), held_bytes=10)
    assert planner.status("x") is PrefetchStatus.READY
    assert planner.allocated("x") is PrefetchStatus.READY  # loaded: it leaves the planner
    assert planner.end_step(True)[1] == []  # (the workers hand it over, no release)
    c = counters.totals()
    assert c["prefetch_started"] == 2 and c["prefetch_ready"] == 1
    assert c["prefetch_released"] == 1 and c["prefetch_bytes_held"] == 10


def test_planner_deadline_failures_and_idle_steps() -> None:
    clock = Clock()
    counters = Counters()
    planner = PrefetchPlanner(timeout_s=2.0, counters=counters, clock=clock)
    for name in ("late", "failed", "idle"):
        planner.need(f"r-{name}", name, name, 16, 32)
    orders, _, _ = planner.end_step(True)
    by_name = {o.mm_hash: o.order_id for o in orders}
    # A rank failed one: a miss, released on the ranks that hold it.
    assert planner.on_report(ready={by_name["failed"]}, failed={by_name["failed"]},
                             held_bytes=0) == {"failed"}  # fmt: skip
    assert planner.status("failed") is PrefetchStatus.FAILED
    # Past the workers' deadline plus the report's grace: given up, released.
    clock.now += 2.0 + REPORT_GRACE_S
    _, releases, expired = planner.end_step(True)
    assert expired == {"late", "idle"}
    assert sorted(releases) == sorted(by_name.values())
    assert planner.status("late") is PrefetchStatus.FAILED
    # A step that runs nothing ships nothing: what is in transit turns synchronous.
    planner.need("r-new", "new", "new", 16, 32)
    assert planner.end_step(False)[0] == []
    assert planner.status("new") is PrefetchStatus.SYNC
    c = counters.totals()
    assert c["prefetch_sync"] == 1 and c["prefetch_expired"] == 2 and c["prefetch_failed"] == 3
