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

    _COUNTERS: ClassVar[dict[str, str]] = {
        "hits": "Encoder outputs the scheduler found in ec-cache.",
        "misses": "Encoder outputs the scheduler did not find (computed locally).",
        "misses_outage": "Misses answered because ec-cache failed or was cut off.",
        "misses_request_scoped": "Items vLLM named by request, not content: never cached.",
        "exists_failed": "Failed existence requests to ec-cache.",
        "load_items": "Encoder outputs loaded from ec-cache.",
        "load_bytes": "Bytes of encoder outputs loaded from ec-cache.",
        "load_failed": "Encoder outputs that could not be loaded.",
        "load_recomputed": "Failed loads recomputed by the encoder in the same step.",
        "load_prefetched": "Encoder outputs copied to the device from a prefetch.",
        "deferred_requests": "Requests deferred for an existence answer or a prefetch.",
        "deferred_seconds": "Seconds requests were deferred, summed.",
        "prefetch_started": "Entries the workers were asked to prefetch.",
        "prefetch_ready": "Prefetches every worker rank held in time.",
        "prefetch_failed": "Prefetches that failed or came too late (computed instead).",
        "prefetch_released": "Prefetches released unused (request finished, aborted, preempted).",
        "prefetch_sync": "Items loaded synchronously because the engine was otherwise idle.",
        "save_created": "Encoder outputs stored in ec-cache.",
        "save_bytes": "Bytes of encoder outputs stored in ec-cache.",
        "save_present": "Uploads answered 'already present'.",
        "save_failed": "Uploads that failed.",
        "save_dropped": "Encoder outputs not uploaded because the queue was full.",
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
