"""What the connector's scheduler and workers tell each other through vLLM: the step's
metadata (items to load, prefetches to start and to release) and the workers' reports
back (prefetches held, failed). Subclasses of vLLM's classes: imported by
:mod:`ec_cache.vllm` only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import vllm.distributed.ec_transfer.ec_connector.base as vllm_ec_base
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

from ec_cache._vllm.planner import PrefetchOrder

if TYPE_CHECKING:
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorWorkerMetadata as WorkerMetadataBase,
    )
else:
    # vLLM before the worker -> scheduler channel has no such class: loads stay
    # synchronous there (see ec_cache.vllm.ASYNC_LOAD_HOOKS).
    WorkerMetadataBase = getattr(vllm_ec_base, "ECConnectorWorkerMetadata", object)

__all__ = ["ECCacheConnectorMetadata", "ECCacheLoad", "ECCacheWorkerReport"]


@dataclass
class ECCacheLoad:
    """One encoder output for the worker to put into ``encoder_cache`` in this step
    (from its prefetch in host memory, else fetched there and then)."""

    mm_hash: str  # vLLM's identifier: the encoder_cache key
    key: str  # the {hash} path part (cache_key(mm_hash))
    num_embeds: int | None  # expected rows, when vLLM knows them
    width: int | None  # expected hidden size, when vLLM measured it
    req_id: str  # first request that needs it (to recompute on failure)
    input_id: int


@dataclass
class ECCacheConnectorMetadata(ECConnectorMetadata):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """Scheduler -> worker: the items to load in this step, the entries to prefetch
    and the prefetches to release (order ids).

    ``scheduled_encoder_inputs`` is the very dict of this step's ``SchedulerOutput``
    (pickling keeps the identity when vLLM ships the output to a worker process), so
    that a worker whose load failed can add the item to this step's encoder work.
    """

    loads: list[ECCacheLoad] = field(default_factory=list)
    scheduled_encoder_inputs: dict[str, list[int]] | None = None
    prefetch: list[PrefetchOrder] = field(default_factory=list)
    release: list[int] = field(default_factory=list)


@dataclass
class ECCacheWorkerReport(WorkerMetadataBase):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """Worker -> scheduler, every step in ``load_mode: async``: the prefetch orders
    held in host memory, those that failed since the previous report, and the bytes
    of host memory taken."""

    ready: frozenset[int] = frozenset()
    failed: frozenset[int] = frozenset()
    held_bytes: int = 0

    def aggregate(self, other: WorkerMetadataBase) -> ECCacheWorkerReport:
        """Tensor-parallel ranks merged: an order is ready only where every rank
        holds it, failed where any rank failed it."""
        assert isinstance(other, ECCacheWorkerReport)
        return ECCacheWorkerReport(
            ready=self.ready & other.ready,
            failed=self.failed | other.failed,
            held_bytes=self.held_bytes + other.held_bytes,
        )
