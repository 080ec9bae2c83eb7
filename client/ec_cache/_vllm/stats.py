"""The connector's stats as vLLM wants them: one interval's counters, summed across the
scheduler and the workers, reduced to the numbers vLLM logs. A subclass of vLLM's
``ECConnectorStats``: imported by :mod:`ec_cache.vllm` only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

__all__ = ["ECCacheConnectorStats"]

_AVERAGES = {
    "exists_avg_ms": ("exists_seconds", "exists_requests", 1000.0),
    "deferred_avg_ms": ("deferred_seconds", "deferred_requests", 1000.0),
    "load_avg_ms": ("load_seconds", "load_steps", 1000.0),
    "prefetch_fetch_avg_ms": ("prefetch_fetch_seconds", "prefetch_fetched", 1000.0),
    "save_avg_ms": ("save_seconds", "save_uploads", 1000.0),
    "save_queue_avg_ms": ("save_queue_seconds", "save_uploads", 1000.0),
}
# Current values rather than counts: the latest one wins when stats are merged.
_GAUGES = frozenset({"prefetch_bytes_held"})


@dataclass
class ECCacheConnectorStats(ECConnectorStats):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """Counters of one interval; summed across workers and the scheduler by vLLM.

    Keys (all optional): ``hits``, ``hits_local`` (answered from the LRU), ``misses``,
    ``misses_outage`` (answered "miss" because the server failed or the breaker was
    open), ``misses_request_scoped`` (items vLLM named by request: never cached),
    ``exists_requests``/``exists_seconds``/``exists_failed``, ``breaker_opened``,
    ``deferred_requests``/``deferred_seconds``, ``prefetch_started``/``prefetch_ready``/
    ``prefetch_failed``/``prefetch_expired``/``prefetch_released``/``prefetch_sync``
    and the gauge ``prefetch_bytes_held`` (scheduler), ``prefetch_fetched``/
    ``prefetch_fetch_bytes``/``prefetch_fetch_seconds``/``prefetch_fetch_failed``/
    ``prefetch_dropped``/``prefetch_budget_waits``/``prefetch_held_expired`` (workers),
    ``load_items``/``load_prefetched``/``load_bytes``/``load_seconds``/``load_steps``/
    ``load_failed``/``load_recomputed``/``load_retries``, ``save_enqueued``/
    ``save_created``/``save_present``/``save_bytes``/``save_seconds``/``save_failed``/
    ``save_dropped``/``save_dropped_bytes``/``save_skipped_*``.
    """

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        for name, value in other.data.items():
            if name in _GAUGES:
                self.data[name] = value
            elif isinstance(value, int | float):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            k: (round(v, 6) if isinstance(v, float) else v)
            for k, v in sorted(self.data.items())
            if isinstance(v, int | float) and not k.endswith("_seconds")
        }
        data = dict(self.data)
        data["save_uploads"] = data.get("save_created", 0) + data.get("save_present", 0)
        for name, (total, count, scale) in _AVERAGES.items():
            if data.get(count):
                out[name] = round(data.get(total, 0) / data[count] * scale, 3)
        asked = data.get("hits", 0) + data.get("misses", 0)
        if asked:
            out["hit_rate"] = round(data.get("hits", 0) / asked, 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())
