"""ECCacheConnector against vLLM 0.33's own classes and a real ec-cache server.

Nothing is mocked between vLLM and the connector or between the connector and the
server: configs come from vLLM's CLI parser type, the connector from vLLM's factory,
requests and scheduler outputs are vLLM's classes, the server is ``python -m app``.
This module holds what concerns the facade and both roles together (the factory,
settings, stats and metrics, replicas); each role alone: test_scheduler.py and
test_worker.py; the asynchronous protocol between them: test_async_loads.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="tests/vllm run in .venv-vllm (scripts/setup-vllm-venv.sh)")

import pickle
from collections.abc import Callable
from typing import Any

import torch
from conftest import Server
from ec_cache.vllm import ECCacheConnector
from helpers import (
    DTYPE,
    SCHED,
    SYNC,
    WORKER,
    embeds,
    get_raw,
    make_request,
    mm_hash,
    ns,
    put_raw,
    step,
    tiny_model_config,
)

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

    model_config = tiny_model_config(tmp_path, "float16")
    with pytest.raises(ValueError, match=r"set ec_connector_extra_config\.model"):
        connector(SCHED, {"url": server.url}, model_config=model_config)
    conn = connector(SCHED, {"url": server.url, "model": "org/tiny"}, model_config=model_config)
    assert (conn.model, conn.dtype) == ("org/tiny", "float16")


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

    # Every counter of docs/vllm.md, as vllm:ec_cache_<name>_total.
    documented = _documented_counters() - {"prefetch_bytes_held"}
    before = {
        name: REGISTRY.get_sample_value(f"vllm:ec_cache_{name}_total", labels) or 0
        for name in documented
    }
    prom.observe({name: 3 for name in documented}, 0)
    for name in documented:
        after = REGISTRY.get_sample_value(f"vllm:ec_cache_{name}_total", labels)
        assert after == before[name] + 3, name


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


def _documented_counters() -> set[str]:
    """The counters of docs/vllm.md's Metrics table (the first column's names)."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([a-z_]+)`", row)}


def test_every_counter_is_documented() -> None:
    """docs/vllm.md lists each counter the connector's code adds, and nothing else
    (test_stats_through_vllm_hooks: each listed one reaches Prometheus)."""
    import re
    from pathlib import Path

    import ec_cache._vllm as parts

    source = "\n".join(p.read_text() for p in Path(parts.__file__).parent.glob("*.py"))
    added = {  # the names in each first argument ("hits" if answer else "misses")
        name
        for argument in re.findall(r"counters\.(?:add|set)\(([^,)]*)", source)
        for name in re.findall(r'"([a-z_]+)"', argument)
    }
    assert added == _documented_counters()
