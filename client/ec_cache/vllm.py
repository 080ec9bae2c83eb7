"""vLLM encoder-cache connector backed by an ec-cache server.

Load it with::

    vllm serve Qwen/Qwen2.5-VL-7B-Instruct --ec-transfer-config '{
        "ec_connector": "ECCacheConnector",
        "ec_connector_module_path": "ec_cache.vllm",
        "ec_role": "ec_both",
        "ec_connector_extra_config": {"url": "http://ec-cache:8080"}}'

vLLM's ``ECConnectorFactory`` imports this module and builds
``ECCacheConnector(vllm_config, role)`` once in the scheduler (role ``SCHEDULER``) and
once in every worker (role ``WORKER``). See ``docs/vllm.md`` for the keys of
``ec_connector_extra_config``, what happens on misses and outages, and the tested vLLM
versions.

This module is a facade, as vLLM's own Mooncake EC connector is: it parses the
settings and builds the object of its role, to which every hook of that role goes.

* :class:`ec_cache._vllm.scheduler.ConnectorScheduler` (scheduler process): existence
  answers, the plan of prefetches, the step's metadata;
* :class:`ec_cache._vllm.worker.ConnectorWorker` (each worker): prefetches, loads,
  uploads.

``ECCacheConnectorConfig``, ``ECCacheConnectorMetadata``, ``ECCacheConnectorStats``,
``ECCacheLoad`` and ``ECCacheWorkerReport`` are importable from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import vllm.distributed.ec_transfer.ec_connector.base as vllm_ec_base
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

from ec_cache._vllm.config import ECCacheConnectorConfig, resolve_namespace
from ec_cache._vllm.counters import Counters
from ec_cache._vllm.logs import ConnectorLog, logger
from ec_cache._vllm.messages import ECCacheConnectorMetadata, ECCacheLoad, ECCacheWorkerReport
from ec_cache._vllm.metrics import ECCachePromMetrics
from ec_cache._vllm.scheduler import ConnectorScheduler
from ec_cache._vllm.shapes import config_width
from ec_cache._vllm.stats import ECCacheConnectorStats
from ec_cache._vllm.worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

# Whether this vLLM lets the connector defer a request and hear back from its
# workers: the scheduler calls ensure_cache_available and update_connector_output,
# the model runner build_connector_worker_meta (vLLM 0.32 and 0.33 do).
ASYNC_LOAD_HOOKS = hasattr(vllm_ec_base, "ECConnectorWorkerMetadata") and all(
    hasattr(ECConnectorBase, name)
    for name in ("ensure_cache_available", "update_connector_output", "build_connector_worker_meta")
)

__all__ = [
    "ECCacheConnector",
    "ECCacheConnectorConfig",
    "ECCacheConnectorMetadata",
    "ECCacheConnectorStats",
    "ECCacheLoad",
    "ECCacheWorkerReport",
]


def _warn_about_request_scoped_names(vllm_config: VllmConfig) -> None:
    mm_config = getattr(getattr(vllm_config, "model_config", None), "multimodal_config", None)
    cache_config = getattr(vllm_config, "cache_config", None)
    if (
        getattr(mm_config, "mm_processor_cache_gb", None) == 0
        and cache_config is not None
        and not getattr(cache_config, "enable_prefix_caching", True)
    ):
        logger.warning(
            "ec-cache: with --mm-processor-cache-gb 0 and prefix caching off, vLLM "
            "names multimodal items by request, not by content; items without "
            "multi_modal_uuids are neither loaded from nor saved to ec-cache"
        )


class ECCacheConnector(ECConnectorBase):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """vLLM ``ECConnectorBase`` over an ec-cache server (see the module docstring):
    ``scheduler`` is set in the scheduler's connector, ``worker`` in a worker's."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec_config = vllm_config.ec_transfer_config
        assert ec_config is not None  # checked by the base class
        self.config = cfg = ECCacheConnectorConfig.from_extra_config(
            dict(ec_config.ec_connector_extra_config or {})
        )
        self.model, self.dtype = resolve_namespace(cfg, vllm_config)
        self._counters = Counters()
        self._log = ConnectorLog(role.name.lower(), self._counters, cfg.log_interval_s)
        self._closed = False
        self.async_loads = cfg.load_mode == "async" and ASYNC_LOAD_HOOKS
        if cfg.load_mode == "async" and not ASYNC_LOAD_HOOKS:
            logger.info(
                "ec-cache: this vLLM cannot defer a request for its connector; loads "
                "are synchronous (load_mode: sync)"
            )
        _warn_about_request_scoped_names(vllm_config)
        self.scheduler: ConnectorScheduler | None = None
        self.worker: ConnectorWorker | None = None
        saves = bool(self.is_producer if cfg.save is None else cfg.save)
        if role == ECConnectorRole.SCHEDULER:
            self.scheduler = ConnectorScheduler(
                cfg,
                self.model,
                self.dtype,
                consumer=self.is_consumer,
                saves=saves,
                async_loads=self.async_loads,
                widths=dict(getattr(ec_config, "mm_encoder_output_widths", {})),
                counters=self._counters,
                log=self._log,
            )
        else:
            parallel = vllm_config.parallel_config
            self.worker = ConnectorWorker(
                cfg,
                self.model,
                self.dtype,
                consumer=self.is_consumer,
                save=saves,
                async_loads=self.async_loads,
                width=config_width(getattr(vllm_config, "model_config", None)),
                tp_world=int(getattr(parallel, "tensor_parallel_size", 1))
                * int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
                counters=self._counters,
                log=self._log,
            )
        logger.info(
            "ec-cache connector (%s, %s): %s, namespace %s/%s, %s loads",
            role.name.lower(),
            ec_config.ec_role,
            ",".join(cfg.urls),
            self.model,
            self.dtype,
            "asynchronous" if self.async_loads else "synchronous",
        )

    # ------------------------------------------------------------------ common

    def counters(self) -> dict[str, float]:
        """Lifetime totals of every counter of this connector instance (plain dict,
        for tests and for deployments without vLLM's stats loggers)."""
        return self._counters.totals()

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        if self.scheduler is not None:
            self.scheduler.note_stats()
        data = self._counters.take()
        return ECCacheConnectorStats(data=data) if data else None

    @classmethod
    def build_ec_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> ECConnectorStats | None:
        return ECCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ECConnectorPromMetrics | None:
        return ECCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued uploads are done (tests, shutdown); ``False`` on timeout."""
        return self.worker.flush(timeout) if self.worker is not None else True

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # --------------------------------------------------------------- scheduler

    def _scheduler(self) -> ConnectorScheduler:
        assert self.scheduler is not None, "a scheduler hook called on a worker's connector"
        return self.scheduler

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """vLLM (0.32+) calls this before it looks at a request's encoder inputs;
        ``False`` defers the request to a later step."""
        if self.scheduler is None:
            return True
        return self.scheduler.ensure_cache_available(request, num_computed_tokens)

    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler().has_cache_item(identifier)

    def has_caches(self, request: Request) -> list[bool]:
        return self._scheduler().has_caches(request)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self._scheduler().update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        self._log.maybe_log_totals()
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        report = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(report, ECCacheWorkerReport):
            self._scheduler().update_connector_output(report)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().request_finished(request.request_id)
        return False, None

    # ------------------------------------------------------------------ worker

    def _worker(self) -> ConnectorWorker:
        assert self.worker is not None, "a worker hook called on the scheduler's connector"
        return self.worker

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self._log.maybe_log_totals()
        meta = self._connector_metadata
        if isinstance(meta, ECCacheConnectorMetadata):
            self._worker().start_load_caches(encoder_cache, meta)

    def build_connector_worker_meta(self) -> ECCacheWorkerReport | None:
        return self._worker().report()

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        self._log.maybe_log_totals()
        self._worker().save_caches(encoder_cache, mm_hash)
