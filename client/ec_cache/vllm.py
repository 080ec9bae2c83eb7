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
versions. This module holds the connector; its parts are in :mod:`ec_cache._vllm`
(only ``messages``, ``stats`` and ``metrics`` there import vLLM, and only this module
imports them). ``ECCacheConnectorConfig``, ``ECCacheConnectorMetadata``,
``ECCacheConnectorStats``, ``ECCacheLoad`` and ``ECCacheWorkerReport`` are importable
from here.

Scheduler side
    vLLM calls ``ensure_cache_available(request, ...)`` before it looks at a
    request's encoder inputs; ``False`` defers the request to a later step. The
    connector asks the server about every item of the request still to be computed
    in ONE ``POST _exists``, on a background thread, waiting for it at most
    ``exists_wait_s`` (then the request waits, not the scheduling loop). Answers are
    kept: positives in a bounded LRU (entries are immutable), negatives for the step
    and ``miss_ttl_s``. Failures feed a circuit breaker; while it is open every
    question is answered "miss" without touching the network. See
    ``ec_cache._vllm.existence``.

    With ``load_mode: async`` (the default where vLLM has the hooks) an item found
    in ec-cache is ordered from the workers through the step's metadata, and the
    request is deferred until every worker rank reports it in host memory (the
    ranks' reports are merged by ``ECConnectorWorkerMetadata.aggregate``); a failed
    or late prefetch makes the item a miss, computed by the encoder. See
    ``ec_cache._vllm.planner``.

Worker side
    Prefetch orders run on background threads into host buffers (pinned on a GPU
    worker) within ``prefetch_buffer_bytes`` (``ec_cache._vllm.prefetch``);
    ``start_load_caches`` then only copies the held bytes to the device. Items to
    load without a prefetch (``load_mode: sync``, an idle engine) are fetched there,
    concurrently, straight to the worker's own device; each is checked for its row
    count before it goes into vLLM's ``encoder_cache``. ``save_caches`` only stages
    a host copy (a pinned buffer on a side stream on CUDA:
    ``ec_cache._cuda.SideStreamStager``) and queues it; daemon threads upload it
    (``ec_cache._vllm.uploader``). One tensor-parallel rank uploads; the server's
    first-writer-wins makes a duplicate upload harmless (it is answered 200 and
    stores nothing).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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

import ec_cache
from ec_cache._buffers import BufferPool
from ec_cache._cuda import SideStreamStager, wait_for_default_stream
from ec_cache._tensors import DTYPES
from ec_cache._vllm.breaker import CircuitBreaker
from ec_cache._vllm.config import ECCacheConnectorConfig, resolve_namespace
from ec_cache._vllm.counters import Counters
from ec_cache._vllm.existence import Existence
from ec_cache._vllm.keys import cache_key, request_scoped
from ec_cache._vllm.messages import ECCacheConnectorMetadata, ECCacheLoad, ECCacheWorkerReport
from ec_cache._vllm.metrics import ECCachePromMetrics
from ec_cache._vllm.planner import PrefetchOrder, PrefetchPlanner, PrefetchStatus
from ec_cache._vllm.prefetch import Prefetcher, check_shape, fetch_until
from ec_cache._vllm.stats import ECCacheConnectorStats
from ec_cache._vllm.ttl_cache import TTLCache
from ec_cache._vllm.uploader import BackgroundUploader, UploadJob

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

# A child of vLLM's "vllm" logger, so that vLLM's logging configuration shows it.
logger = logging.getLogger("vllm.ec_cache")

# How long a step that runs nothing waits for an existence answer in flight.
_IDLE_STEP_WAIT_S = 0.001


def _default_load_device() -> str:
    """The worker's own device: ``cuda:{current_device()}``, never bare ``cuda``
    (which would mean ``cuda:0`` on every tensor-parallel rank)."""
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def _stage_host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """CPU (and other non-CUDA) tensors: hold a reference, no copy. vLLM never writes
    into an encoder output once it is in ``encoder_cache`` (later prefill chunks read
    it from there), so holding it until the upload is done is safe."""
    return tensor.detach()


def _num_embeds(request: Request, index: int) -> int | None:
    """The rows vLLM expects for item ``index`` of ``request`` (None: unknown)."""
    try:
        return int(request.get_num_encoder_embeds(index))
    except AttributeError:  # older vLLM
        try:
            return int(request.mm_features[index].mm_position.get_num_embeds())
        except AttributeError:
            return None


def _tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 when vLLM's groups are not set up)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


def _prefill_context_parallel_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pcp_group

        return int(get_pcp_group().rank_in_group)
    except Exception:
        return 0


def _make_client(
    cfg: ECCacheConnectorConfig,
    model: str,
    dtype: str,
    *,
    timeout: float,
    attempts: int,
    raise_on_unavailable: bool,
    concurrency: int,
) -> ec_cache.Client:
    return ec_cache.Client(
        list(cfg.urls),
        model=model,
        dtype=dtype,
        token=cfg.token,
        timeouts=ec_cache.Timeouts.of(timeout),
        retries=ec_cache.Retries(attempts=attempts, backoff=min(0.05, timeout / 4)),
        limits=ec_cache.Limits(concurrency=concurrency),
        raise_on_unavailable=raise_on_unavailable,
    )


class ECCacheConnector(ECConnectorBase):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """vLLM ``ECConnectorBase`` over an ec-cache server (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec_config = vllm_config.ec_transfer_config
        assert ec_config is not None  # checked by the base class
        self.config = ECCacheConnectorConfig.from_extra_config(
            dict(ec_config.ec_connector_extra_config or {})
        )
        self.model, self.dtype = resolve_namespace(self.config, vllm_config)
        self._counters = Counters()
        self._widths: dict[str, int] = dict(getattr(ec_config, "mm_encoder_output_widths", {}))
        parallel = vllm_config.parallel_config
        self._tp_world = int(getattr(parallel, "tensor_parallel_size", 1)) * int(
            getattr(parallel, "prefill_context_parallel_size", 1) or 1
        )
        self._closed = False
        cfg = self.config
        self.async_loads = cfg.load_mode == "async" and ASYNC_LOAD_HOOKS
        if cfg.load_mode == "async" and not ASYNC_LOAD_HOOKS:
            logger.info(
                "ec-cache: this vLLM cannot defer a request for its connector; loads "
                "are synchronous (load_mode: sync)"
            )
        # --- scheduler state
        self._client: ec_cache.Client | None = None
        self._breaker = CircuitBreaker(
            cfg.breaker_failures, cfg.breaker_cooldown_s, cfg.breaker_max_cooldown_s
        )
        self._existence = Existence(
            self._exists_many,
            breaker=self._breaker,
            counters=self._counters,
            hits=TTLCache(cfg.hit_cache_size, cfg.hit_ttl_s),
            misses=TTLCache(
                min(cfg.hit_cache_size, 8192) if cfg.miss_ttl_s > 0 else 0, cfg.miss_ttl_s
            ),
            on_failure=lambda exc: self._warn_once(
                "exists",
                "ec-cache: existence check failed, answering 'miss' (%s); further "
                "failures are counted in exists_failed",
                exc,
            ),
        )
        self._planner = PrefetchPlanner(timeout_s=cfg.load_timeout_s, counters=self._counters)
        self._promised: set[str] = set()  # has_cache_item said True this step
        self._resident: set[str] = set()  # in vLLM's encoder cache (alloc/free mirrored)
        self._deferred_since: dict[str, float] = {}  # request id -> first deferral
        self._pending_loads: dict[str, ECCacheLoad] = {}
        # --- worker state
        self._load_client: ec_cache.Client | None = None
        self._upload_client: ec_cache.Client | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._prefetcher: Prefetcher | None = None
        self._uploader: BackgroundUploader | None = None
        self._cuda_stager: SideStreamStager | None = None
        self._known_present: TTLCache[str, bool] = TTLCache(cfg.hit_cache_size, cfg.hit_ttl_s)
        self._warned: set[str] = set()
        self._last_log = time.monotonic()
        self._logged_totals: dict[str, float] = {}
        self._lock = threading.Lock()
        self.save_enabled = bool(self.is_producer if cfg.save is None else cfg.save)

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
        if role == ECConnectorRole.SCHEDULER:
            self._client = _make_client(
                cfg, self.model, self.dtype,
                timeout=cfg.exists_timeout_s, attempts=1,
                raise_on_unavailable=False, concurrency=1,
            )  # fmt: skip
        else:
            self._load_client = _make_client(
                cfg, self.model, self.dtype,
                timeout=min(cfg.load_timeout_s, 30.0), attempts=2,
                raise_on_unavailable=True, concurrency=cfg.load_concurrency,
            )  # fmt: skip
        logger.info(
            "ec-cache connector (%s, %s): %s, namespace %s/%s, %s loads",
            role.name.lower(),
            vllm_config.ec_transfer_config.ec_role if vllm_config.ec_transfer_config else "?",
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
        self._existence.note_breaker()
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
        return self._uploader.flush(timeout) if self._uploader is not None else True

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._uploader is not None:
            self._uploader.close(timeout=self.config.upload_timeout_s)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._existence.close()
        for client in (self._client, self._load_client, self._upload_client):
            if client is not None:
                client.close()

    def _warn_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)

    def _maybe_log_totals(self) -> None:
        """Every ``log_interval_s``, one INFO line with the lifetime counters when
        they changed (vLLM's V1 model runner does not forward worker-side stats)."""
        interval = self.config.log_interval_s
        if interval <= 0 or time.monotonic() - self._last_log < interval:
            return
        self._last_log = time.monotonic()
        totals = self._counters.totals()
        if totals != self._logged_totals:
            self._logged_totals = totals
            logger.info(
                "ec-cache connector (%s) totals: %s",
                self.role.name.lower(),
                ", ".join(f"{k}={round(v, 3)}" for k, v in sorted(totals.items())),
            )

    # --------------------------------------------------------------- scheduler

    def _exists_many(self, identifiers: list[str]) -> list[bool]:
        assert self._client is not None, "existence questions are the scheduler's"
        return self._client.exists_many([cache_key(i) for i in identifiers])

    def _still_needed(self, request: Request, num_computed_tokens: int) -> list[int]:
        """Indexes of ``request``'s cacheable items not yet consumed by its prefill."""
        return [
            index
            for index, feature in enumerate(getattr(request, "mm_features", None) or ())
            if feature.mm_position.offset + feature.mm_position.length > num_computed_tokens
            and not request_scoped(feature.identifier)
        ]

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """vLLM (0.32+) calls this before it looks at a request's encoder inputs;
        ``False`` defers the request to a later step.

        The items still to be computed are asked about in one ``_exists`` on a
        background thread; the request waits for the answer, the scheduling loop at
        most ``exists_wait_s``. With asynchronous loads, each item found is ordered
        from the workers and the request waits until every rank holds it (or the
        prefetch failed: then the encoder computes it). Requests without items in
        ec-cache are never deferred beyond the existence answer."""
        if not self.is_consumer or self.role != ECConnectorRole.SCHEDULER:
            return True
        needed = self._still_needed(request, num_computed_tokens)
        if not needed:
            return True
        existence = self._existence
        existence.collect()
        features = request.mm_features
        identifiers = [features[i].identifier for i in needed]
        unknown = [i for i in identifiers if existence.known(i) is None]
        if unknown:
            existence.ask_in_background(unknown, self.config.exists_wait_s)
        ready = True
        for index in needed:
            identifier = features[index].identifier
            present = existence.known(identifier)
            if present is None:
                ready = False  # the answer is not in yet
            elif present and self.async_loads and identifier not in self._resident:
                status = self._planner.need(
                    request.request_id,
                    identifier,
                    cache_key(identifier),
                    _num_embeds(request, index),
                    self._widths.get(getattr(features[index], "modality", "")),
                )
                ready &= status not in (PrefetchStatus.ORDERED, PrefetchStatus.SHIPPED)
        self._note_deferral(request.request_id, ready)
        return ready

    def _note_deferral(self, request_id: str, ready: bool) -> None:
        if not ready:
            self._deferred_since.setdefault(request_id, time.monotonic())
            return
        since = self._deferred_since.pop(request_id, None)
        if since is not None:
            self._counters.add("deferred_requests")
            self._counters.add("deferred_seconds", time.monotonic() - since)

    def has_cache_item(self, identifier: str) -> bool:
        """Whether vLLM may load ``identifier``'s encoder output instead of computing
        it in this step."""
        if not self.is_consumer:
            return False
        if request_scoped(identifier):
            self._counters.add("misses_request_scoped")
            return False
        existence = self._existence
        existence.collect()
        answer = existence.known(identifier)
        if answer is None:  # a vLLM that did not call ensure_cache_available first
            if existence.is_asking(identifier):
                existence.wait_for(identifier)
            else:
                existence.ask([identifier])
            answer = bool(existence.known(identifier))
        if answer and self.async_loads and identifier not in self._resident:
            # Not planned (no ensure_cache_available): a synchronous load.
            status = self._planner.status(identifier)
            answer = status in (None, PrefetchStatus.READY, PrefetchStatus.SYNC)
        self._counters.add("hits" if answer else "misses")
        if answer:
            self._promised.add(identifier)
            if existence.take_local(identifier):
                self._counters.add("hits_local")
        elif existence.is_outage(identifier):
            self._counters.add("misses_outage")
        return answer

    def has_caches(self, request: Request) -> list[bool]:
        """vLLM 0.11.1-0.14 spelling of the scheduler question: one answer per item
        of ``request``, asked in one round trip. (Not tested: see docs/vllm.md.)"""
        identifiers = [f.identifier for f in getattr(request, "mm_features", None) or ()]
        if not self.is_consumer:
            return [False] * len(identifiers)
        self._existence.ask(
            i for i in identifiers if not request_scoped(i) and self._existence.known(i) is None
        )
        return [self.has_cache_item(i) for i in identifiers]

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """vLLM allocated item ``index`` of ``request`` (to load or to compute): queue
        its load when this step promised it."""
        if not self.is_consumer:
            return
        feature = request.mm_features[index]
        identifier = feature.identifier
        self._resident.add(identifier)
        self._planner.allocated(identifier)
        if identifier not in self._promised or identifier in self._pending_loads:
            return
        self._pending_loads[identifier] = ECCacheLoad(
            mm_hash=identifier,
            key=cache_key(identifier),
            num_embeds=_num_embeds(request, index),
            width=self._widths.get(getattr(feature, "modality", "")),
            req_id=request.request_id,
            input_id=index,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        self._maybe_log_totals()
        for mm_hash in getattr(scheduler_output, "free_encoder_mm_hashes", None) or ():
            self._resident.discard(mm_hash)
        for request_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._planner.drop_request(request_id)
        # The workers see this metadata only when the step runs the model.
        runs = getattr(scheduler_output, "total_num_scheduled_tokens", 1) > 0
        if not runs:
            # Only deferred requests: give the background question a moment, as
            # vLLM's engine loop sleeps 1 ms after such a step (its offline loop
            # does not, and would keep the GIL from the question's thread).
            self._existence.wait_a_little(_IDLE_STEP_WAIT_S)
        orders: list[PrefetchOrder] = []
        releases: list[int] = []
        if self.async_loads:
            orders, releases, expired = self._planner.end_step(runs)
            for mm_hash in expired:
                self._existence.forget_hit(mm_hash)
        meta = ECCacheConnectorMetadata(
            loads=list(self._pending_loads.values()),
            scheduled_encoder_inputs=getattr(scheduler_output, "scheduled_encoder_inputs", None),
            prefetch=orders,
            release=releases,
        )
        self._pending_loads = {}
        self._promised = set()
        self._existence.end_step()
        return meta

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        """The workers' merged report: prefetches now held by every rank, and those
        that failed (misses from now on)."""
        report = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(report, ECCacheWorkerReport) and self.async_loads:
            for mm_hash in self._planner.on_report(report.ready, report.failed, report.held_bytes):
                self._existence.forget_hit(mm_hash)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Release the prefetches nobody else waits for (finished or aborted)."""
        self._planner.drop_request(request.request_id)
        self._deferred_since.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker

    def _load_device(self) -> torch.device:
        return torch.device(self.config.device or _default_load_device())

    def _get_prefetcher(self) -> Prefetcher:
        if self._prefetcher is None:
            assert self._load_client is not None
            on_gpu = self._load_device().type == "cuda"
            self._prefetcher = Prefetcher(
                self._load_client,
                dtype=DTYPES[self.dtype][0],
                budget_bytes=self.config.prefetch_buffer_bytes,
                threads=self.config.load_concurrency,
                timeout_s=self.config.load_timeout_s,
                counters=self._counters,
                # Pinned staging so that the copy to the GPU is asynchronous.
                staging=BufferPool(self.config.prefetch_buffer_bytes, steps=16) if on_gpu else None,
            )
        return self._prefetcher

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Pass the step's prefetch orders and releases to the background threads, then
        put this step's items into ``encoder_cache``: from host memory when prefetched,
        else fetched now, concurrently, onto this worker's device."""
        self._maybe_log_totals()
        meta = self._connector_metadata
        if not isinstance(meta, ECCacheConnectorMetadata):
            return
        if meta.release or meta.prefetch:
            prefetcher = self._get_prefetcher()
            for order_id in meta.release:
                prefetcher.release(order_id)
            for order in meta.prefetch:
                prefetcher.submit(order)
        todo = [load for load in meta.loads if load.mm_hash not in encoder_cache]
        if not todo:
            return
        device = self._load_device()
        started = time.monotonic()
        deadline = started + self.config.load_timeout_s
        results: dict[str, tuple[torch.Tensor | None, str | None]] = {}
        for load in todo:
            entry = self._prefetcher.take(load.mm_hash, deadline) if self._prefetcher else None
            if entry is not None:
                results[load.mm_hash] = (entry.to_device(device), None)
                self._counters.add("load_prefetched")
        network = [load for load in todo if load.mm_hash not in results]
        if network:
            results.update(self._fetch_all(network, device, deadline))
        failed: list[tuple[ECCacheLoad, str]] = []
        for load in todo:
            tensor, error = results[load.mm_hash]
            if tensor is not None:
                error = check_shape(tuple(tensor.shape), load.num_embeds, load.width)
            if error is not None or tensor is None:
                failed.append((load, error or "not found"))
                continue
            encoder_cache[load.mm_hash] = tensor
            self._known_present.put(load.key, True)
            self._counters.add("load_items")
            self._counters.add("load_bytes", tensor.numel() * tensor.element_size())
        if device.type == "cuda":
            wait_for_default_stream(device)
        self._counters.add("load_steps")
        self._counters.add("load_seconds", time.monotonic() - started)
        if failed:
            self._counters.add("load_failed", len(failed))
            self._handle_load_failures(failed, meta)

    def build_connector_worker_meta(self) -> ECCacheWorkerReport | None:
        """With asynchronous loads, every step: what this worker holds and what
        failed. Every rank reports, so that the merge (``aggregate``) sees them all."""
        if not (self.async_loads and self.is_consumer):
            return None
        if self._prefetcher is None:
            return ECCacheWorkerReport()
        report = self._prefetcher.report()
        return ECCacheWorkerReport(report.ready, report.failed, report.held_bytes)

    def _fetch_all(
        self, loads: list[ECCacheLoad], device: torch.device, deadline: float
    ) -> dict[str, tuple[torch.Tensor | None, str | None]]:
        if len(loads) == 1:
            return {loads[0].mm_hash: self._fetch_one(loads[0], device, deadline)}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.config.load_concurrency, thread_name_prefix="ec-cache-load"
            )
        futures = {
            load.mm_hash: self._pool.submit(self._fetch_one, load, device, deadline)
            for load in loads
        }
        out: dict[str, tuple[torch.Tensor | None, str | None]] = {}
        for mm_hash, future in futures.items():
            try:
                out[mm_hash] = future.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
            except Exception as exc:  # timeout of a stuck fetch
                out[mm_hash] = (None, f"{type(exc).__name__}: {exc}")
        return out

    def _fetch_one(
        self, load: ECCacheLoad, device: torch.device, deadline: float
    ) -> tuple[torch.Tensor | None, str | None]:
        """Get one entry, retrying transient failures until ``deadline``."""
        client = self._load_client
        assert client is not None
        return fetch_until(lambda: client.get(load.key, device=device), deadline, self._counters)

    def _handle_load_failures(
        self, failed: list[tuple[ECCacheLoad, str]], meta: ECCacheConnectorMetadata
    ) -> None:
        # Whatever happens next, do not promise these again from the local LRU.
        for load, _ in failed:
            self._known_present.discard(load.key)
        details = "; ".join(f"{load.mm_hash}: {why}" for load, why in failed)
        recompute = (
            self.config.on_load_failure == "recompute"
            and self._tp_world == 1
            and meta.scheduled_encoder_inputs is not None
        )
        if recompute:
            assert meta.scheduled_encoder_inputs is not None
            for load, _ in failed:
                inputs = meta.scheduled_encoder_inputs.setdefault(load.req_id, [])
                if load.input_id not in inputs:
                    inputs.append(load.input_id)
            self._counters.add("load_recomputed", len(failed))
            logger.warning(
                "ec-cache: %d encoder output(s) could not be loaded; the encoder "
                "recomputes them in this step: %s",
                len(failed),
                details,
            )
            return
        why_not = (
            "on_load_failure is 'raise'"
            if self.config.on_load_failure == "raise"
            else "recomputing on one rank is only safe with tensor_parallel_size=1"
            if self._tp_world != 1
            else "this vLLM does not pass the step's encoder inputs to the connector"
        )
        raise RuntimeError(
            f"ec-cache: could not load {len(failed)} encoder output(s) that the "
            f"scheduler found in ec-cache ({', '.join(self.config.urls)}, namespace "
            f"{self.model}/{self.dtype}), and they cannot be recomputed ({why_not}). "
            f"vLLM cannot run this step without them. {details}"
        )

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """Queue ``encoder_cache[mm_hash]`` for a background upload; never blocks on
        the network."""
        if not self.save_enabled or self._closed:
            return
        self._maybe_log_totals()
        if not self.config.save_all_ranks and (
            _tensor_parallel_rank() != 0 or _prefill_context_parallel_rank() != 0
        ):
            self._counters.add("save_skipped_rank")
            return
        if request_scoped(mm_hash):
            self._counters.add("save_skipped_request_scoped")
            return
        key = cache_key(mm_hash)
        if self._known_present.get(key):
            self._counters.add("save_skipped_known")
            return
        tensor = encoder_cache.get(mm_hash)
        if tensor is None:
            return
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype != self.dtype:
            self._counters.add("save_skipped_dtype")
            self._warn_once(
                "dtype",
                "ec-cache: encoder output %s is %s but the namespace dtype is %s; such "
                "outputs are not saved (set ec_connector_extra_config.dtype)",
                mm_hash,
                dtype,
                self.dtype,
            )
            return
        nbytes = tensor.numel() * tensor.element_size()
        uploader = self._get_uploader()
        if nbytes > self.config.save_queue_bytes:
            self._counters.add("save_dropped")
            self._counters.add("save_dropped_bytes", nbytes)
            return
        if tensor.device.type == "cuda":
            if self._cuda_stager is None:
                self._cuda_stager = SideStreamStager()
            host, ready = self._cuda_stager.stage(tensor)
        else:
            host, ready = _stage_host_tensor(tensor), None
        if uploader.submit(UploadJob(key=key, tensor=host, nbytes=nbytes, ready=ready)):
            self._known_present.put(key, True)

    def _get_uploader(self) -> BackgroundUploader:
        with self._lock:
            if self._uploader is None:
                client = _make_client(
                    self.config, self.model, self.dtype,
                    timeout=self.config.upload_timeout_s, attempts=2,
                    raise_on_unavailable=True, concurrency=self.config.upload_threads,
                )  # fmt: skip
                self._upload_client = client
                self._uploader = BackgroundUploader(
                    client.put,
                    counters=self._counters,
                    max_items=self.config.save_queue_items,
                    max_bytes=self.config.save_queue_bytes,
                    threads=self.config.upload_threads,
                )
            return self._uploader
