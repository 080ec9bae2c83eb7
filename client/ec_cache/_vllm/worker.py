"""The connector's worker role: prefetches into host memory, loads into vLLM's
``encoder_cache``, and background uploads of computed outputs. Built by
:class:`ec_cache.vllm.ECCacheConnector` in each worker process only.

Prefetch orders run on background threads into host buffers (pinned on a GPU worker)
within ``prefetch_buffer_bytes`` (:mod:`.prefetch`); ``start_load_caches`` then only
copies the held bytes to the device. Items to load without a prefetch (``load_mode:
sync``, an idle engine) are fetched there, concurrently, straight to the worker's own
device. Every entry is checked for its rows and its width (:mod:`.shapes`) before it
goes into ``encoder_cache``: a wrong shape is a failed load, never a wrong tensor.
``save_caches`` only stages a host copy (a pinned buffer on a side stream on CUDA:
``ec_cache._cuda.SideStreamStager``) and queues it; daemon threads upload it
(:mod:`.uploader`). One tensor-parallel rank uploads; the server's first-writer-wins
makes a duplicate upload harmless (it is answered 200 and stores nothing).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import ec_cache
from ec_cache._buffers import BufferPool
from ec_cache._cuda import SideStreamStager, wait_for_default_stream
from ec_cache._tensors import DTYPES
from ec_cache._vllm.config import ECCacheConnectorConfig, make_client
from ec_cache._vllm.counters import Counters
from ec_cache._vllm.keys import cache_key, request_scoped
from ec_cache._vllm.logs import ConnectorLog, logger
from ec_cache._vllm.messages import ECCacheConnectorMetadata, ECCacheLoad, ECCacheWorkerReport
from ec_cache._vllm.prefetch import Prefetcher, fetch_until
from ec_cache._vllm.shapes import EncoderWidth, check_shape
from ec_cache._vllm.ttl_cache import TTLCache
from ec_cache._vllm.uploader import BackgroundUploader, UploadJob

__all__ = ["ConnectorWorker"]

_Result = tuple[torch.Tensor | None, str | None]

STAGING_MIN_BYTES = 4096


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


class ConnectorWorker:
    """The worker's side of one connector. ``consumer``: whether it loads;
    ``save``: whether it uploads what its encoder computes; ``async_loads``: whether
    it reports prefetches to the scheduler; ``width``: the encoder output width the
    model's config implies (the first computed output overrides it); ``tp_world``:
    ranks that must agree on a step (a failed load is recomputed only when 1)."""

    def __init__(
        self,
        config: ECCacheConnectorConfig,
        model: str,
        dtype: str,
        *,
        consumer: bool,
        save: bool,
        async_loads: bool,
        width: int | None,
        tp_world: int,
        counters: Counters,
        log: ConnectorLog,
    ) -> None:
        self.config = config
        self._model, self._dtype = model, dtype
        self._consumer = consumer
        self.save_enabled = save
        self._async_loads = async_loads
        self._width = EncoderWidth(width)
        self._tp_world = tp_world
        self._counters = counters
        self._log = log
        self._load_client: ec_cache.Client = make_client(
            config, model, dtype,
            timeout=min(config.load_timeout_s, 30.0), attempts=2,
            raise_on_unavailable=True, concurrency=config.load_concurrency,
        )  # fmt: skip
        self._upload_client: ec_cache.Client | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.prefetcher: Prefetcher | None = None
        self._uploader: BackgroundUploader | None = None
        self._cuda_stager: SideStreamStager | None = None
        # Keys this worker loaded or queued for upload: not uploaded again.
        self._known_present: TTLCache[str, bool] = TTLCache(config.hit_cache_size, config.hit_ttl_s)
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ loads

    def _load_device(self) -> torch.device:
        return torch.device(self.config.device or _default_load_device())

    def _get_prefetcher(self) -> Prefetcher:
        if self.prefetcher is None:
            on_gpu = self._load_device().type == "cuda"
            self.prefetcher = Prefetcher(
                self._load_client,
                dtype=DTYPES[self._dtype][0],
                budget_bytes=self.config.prefetch_buffer_bytes,
                threads=self.config.load_concurrency,
                timeout_s=self.config.load_timeout_s,
                counters=self._counters,
                min_rate=self.config.load_min_bytes_per_s or None,
                on_failure=self._known_present.discard,
                # Pinned staging so that the copy to the GPU is asynchronous; size
                # classes 1/16 apart from one page up, so that small entries count
                # (and take) about their own size in the budget.
                staging=BufferPool(
                    self.config.prefetch_buffer_bytes, steps=16, min_capacity=STAGING_MIN_BYTES
                )
                if on_gpu
                else None,
            )
        return self.prefetcher

    def start_load_caches(
        self, encoder_cache: dict[str, torch.Tensor], meta: ECCacheConnectorMetadata
    ) -> None:
        """Pass the step's prefetch orders and releases to the background threads, then
        put this step's items into ``encoder_cache``: from host memory when prefetched,
        else fetched now, concurrently, onto this worker's device."""
        if meta.release or meta.prefetch:
            prefetcher = self._get_prefetcher()
            for order_id in meta.release:
                prefetcher.release(order_id)
            for order in meta.prefetch:
                prefetcher.submit(
                    dataclasses.replace(order, width=self._width.expected(order.width))
                )
        todo = [load for load in meta.loads if load.mm_hash not in encoder_cache]
        if not todo:
            return
        device = self._load_device()
        started = time.monotonic()
        deadline = started + self.config.load_timeout_s
        results: dict[str, _Result] = {}
        for load in todo:
            entry = self.prefetcher.take(load.mm_hash, deadline) if self.prefetcher else None
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
                width = self._width.expected(load.width)
                error = check_shape(tuple(tensor.shape), load.num_embeds, width)
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

    def report(self) -> ECCacheWorkerReport | None:
        """With asynchronous loads, every step: what this worker holds and what
        failed. Every rank reports, so that the merge (``aggregate``) sees them all."""
        if not (self._async_loads and self._consumer):
            return None
        if self.prefetcher is None:
            return ECCacheWorkerReport()
        report = self.prefetcher.report()
        return ECCacheWorkerReport(report.ready, report.failed, report.held_bytes)

    def _fetch_all(
        self, loads: list[ECCacheLoad], device: torch.device, deadline: float
    ) -> dict[str, _Result]:
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
        out: dict[str, _Result] = {}
        for mm_hash, future in futures.items():
            try:
                out[mm_hash] = future.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
            except Exception as exc:  # timeout of a stuck fetch
                out[mm_hash] = (None, f"{type(exc).__name__}: {exc}")
        return out

    def _fetch_one(self, load: ECCacheLoad, device: torch.device, deadline: float) -> _Result:
        """Get one entry, retrying transient failures until ``deadline``."""
        client = self._load_client
        return fetch_until(
            lambda: client.get(
                load.key,
                device=device,
                timeout=deadline - time.monotonic(),
                min_rate=self.config.load_min_bytes_per_s or None,
            ),
            deadline,
            self._counters,
        )

    def _handle_load_failures(
        self, failed: list[tuple[ECCacheLoad, str]], meta: ECCacheConnectorMetadata
    ) -> None:
        # Whatever happens next, do not promise these again from the local LRU: the
        # recomputed output is uploaded anew.
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
            f"{self._model}/{self._dtype}), and they cannot be recomputed ({why_not}). "
            f"vLLM cannot run this step without them. {details}"
        )

    # ------------------------------------------------------------------ saves

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        """Queue ``encoder_cache[mm_hash]`` (an output this worker's encoder computed)
        for a background upload; never blocks on the network."""
        tensor = encoder_cache.get(mm_hash)
        if tensor is not None:
            self._width.learn(tuple(tensor.shape))
        if not self.save_enabled or self._closed:
            return
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
        if tensor is None:
            return
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype != self._dtype:
            self._counters.add("save_skipped_dtype")
            self._log.warn_once(
                "dtype",
                "ec-cache: encoder output %s is %s but the namespace dtype is %s; such "
                "outputs are not saved (set ec_connector_extra_config.dtype)",
                mm_hash,
                dtype,
                self._dtype,
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
                client = make_client(
                    self.config, self._model, self._dtype,
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

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued uploads are done (tests, shutdown); ``False`` on timeout."""
        return self._uploader.flush(timeout) if self._uploader is not None else True

    def close(self) -> None:
        self._closed = True
        if self._uploader is not None:
            self._uploader.close(timeout=self.config.upload_timeout_s)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.prefetcher is not None:
            self.prefetcher.close()
        for client in (self._load_client, self._upload_client):
            if client is not None:
                client.close()
