"""The connector's Prometheus metrics, fed by vLLM from the stats of each interval
(:mod:`ec_cache._vllm.stats`). A subclass of vLLM's ``ECConnectorPromMetrics``:
imported by :mod:`ec_cache.vllm` only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["ECCachePromMetrics"]


class ECCachePromMetrics(ECConnectorPromMetrics):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """Prometheus counters ``vllm:ec_cache_<name>_total`` for the numeric stats, and
    the gauge ``vllm:ec_cache_prefetch_bytes_held``."""

    # Every counter of docs/vllm.md (Metrics), each one ``vllm:ec_cache_<name>_total``.
    _COUNTERS: ClassVar[dict[str, str]] = {
        "hits": "Encoder outputs the scheduler found in ec-cache.",
        "hits_local": "Hits answered from the scheduler's LRU of positives, without a request.",
        "misses": "Encoder outputs the scheduler did not find (computed locally).",
        "misses_outage": "Misses answered because ec-cache failed or was cut off.",
        "misses_request_scoped": "Items vLLM named by request, not content: never cached.",
        "exists_requests": "Existence requests (POST _exists) to ec-cache.",
        "exists_seconds": "Seconds of existence requests, summed.",
        "exists_failed": "Failed existence requests to ec-cache.",
        "breaker_opened": "Times the circuit breaker in front of ec-cache opened.",
        "claims_granted": "Missing items this engine claimed (it encodes and uploads them).",
        "claims_contended": "Items another engine was computing: their requests waited.",
        "claims_landed": "Waited-for items that landed in ec-cache (then loaded).",
        "claims_computed_after_wait": "Waited-for items computed here after all (claim "
        "ended without an entry, or claim_wait_s passed).",
        "claims_wait_seconds": "Seconds items waited for another engine's claim, summed.",
        "deferred_requests": "Requests deferred for an existence answer or a prefetch.",
        "deferred_seconds": "Seconds requests were deferred, summed.",
        "prefetch_started": "Entries the workers were asked to prefetch.",
        "prefetch_ready": "Prefetches every worker rank held in time.",
        "prefetch_failed": "Prefetches that failed or came too late (computed instead).",
        "prefetch_expired": "Prefetches not held by every rank before their deadline.",
        "prefetch_released": "Prefetches released unused (request finished, aborted, preempted).",
        "prefetch_sync": "Items loaded synchronously because the engine was otherwise idle.",
        "prefetch_fetched": "Entries the workers fetched into host memory.",
        "prefetch_fetch_bytes": "Bytes the workers fetched into host memory.",
        "prefetch_fetch_seconds": "Seconds from a prefetch order to its entry held, summed.",
        "prefetch_fetch_failed": "Prefetches a worker could not fetch.",
        "prefetch_dropped": "Prefetches a worker dropped on release (held or in flight).",
        "prefetch_budget_waits": "Prefetches that waited for room in prefetch_buffer_bytes.",
        "prefetch_held_expired": "Held prefetches dropped by the guard (never taken or released).",
        "load_items": "Encoder outputs loaded from ec-cache.",
        "load_prefetched": "Encoder outputs copied to the device from a prefetch.",
        "load_bytes": "Bytes of encoder outputs loaded from ec-cache.",
        "load_seconds": "Seconds of worker loads in start_load_caches, summed.",
        "load_steps": "Steps in which a worker loaded encoder outputs.",
        "load_failed": "Encoder outputs that could not be loaded.",
        "load_recomputed": "Failed loads recomputed by the encoder in the same step.",
        "load_retries": "Retried GETs and HEADs of loads and prefetches.",
        "save_enqueued": "Encoder outputs queued for upload.",
        "save_created": "Encoder outputs stored in ec-cache.",
        "save_present": "Uploads answered 'already present'.",
        "save_bytes": "Bytes of encoder outputs stored in ec-cache.",
        "save_seconds": "Seconds of uploads, summed.",
        "save_queue_seconds": "Seconds uploads waited in the queue, summed.",
        "save_failed": "Uploads that failed.",
        "save_dropped": "Encoder outputs not uploaded because the queue was full.",
        "save_dropped_bytes": "Bytes of encoder outputs not uploaded because the queue was full.",
        "save_skipped_rank": "Encoder outputs not uploaded: another rank uploads them.",
        "save_skipped_known": "Encoder outputs not uploaded: already loaded or queued here.",
        "save_skipped_dtype": "Encoder outputs not uploaded: not the namespace's dtype.",
        "save_skipped_request_scoped": "Items named by request, not content: never saved.",
    }

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, dict[int, Any]] = {}
        for name, doc in self._COUNTERS.items():
            counter = self._counter_cls(
                name=f"vllm:ec_cache_{name}", documentation=doc, labelnames=labelnames
            )
            self._metrics[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        gauge_cls: Any = self._gauge_cls  # vLLM's Gauge (or its multiprocess wrapper)
        gauge = gauge_cls(
            name="vllm:ec_cache_prefetch_bytes_held",
            documentation="Bytes of host memory the workers hold for prefetched entries.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._bytes_held: dict[int, Any] = {
            idx: gauge.labels(*values) for idx, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._metrics.items():
            value = transfer_stats_data.get(name)
            if isinstance(value, int | float) and value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
        held = transfer_stats_data.get("prefetch_bytes_held")
        if isinstance(held, int | float) and engine_idx in self._bytes_held:
            self._bytes_held[engine_idx].set(held)
