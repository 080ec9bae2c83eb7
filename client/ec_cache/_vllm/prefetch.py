"""The worker's side of asynchronous loads: entries fetched into host memory by
background threads, within a byte budget, before vLLM schedules the request that
needs them (no vLLM import).

The scheduler orders an entry (:class:`~ec_cache._vllm.planner.PrefetchOrder`); a
thread learns its shape (from the order, else a ``HEAD``), waits for room in the
budget, and receives the body straight into a host buffer (pinned and pooled when the
worker's device is a GPU). The worker reports what it holds at the end of each step;
once every rank holds it the scheduler lets the request run, and ``start_load_caches``
only copies it to the device. A failure (404, 503, reset, timeout, a corrupted body, a
wrong shape) is reported and the entry becomes a miss: nothing wrong is ever used.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

import ec_cache
from ec_cache._buffers import BufferPool, PooledBuffer, typed_view
from ec_cache._config import backoff
from ec_cache._cuda import copy_to_device
from ec_cache._sync.retries import retried
from ec_cache._tensors import EntryInfo
from ec_cache._vllm.counters import Counters
from ec_cache._vllm.planner import PrefetchOrder

__all__ = ["HostEntry", "PrefetchReport", "Prefetcher", "check_shape", "fetch_until"]

# A child of vLLM's "vllm" logger, so that vLLM's logging configuration shows it.
logger = logging.getLogger("vllm.ec_cache")

T = TypeVar("T")

# Failures that a later attempt may not meet: 503, transport errors, a corrupted body.
_TRANSIENT = (ec_cache.UnavailableError, ec_cache.TransportError, ec_cache.IntegrityError)


def fetch_until(
    call: Callable[[], T | None],
    deadline: float,
    counters: Counters,
    stop: Callable[[], bool] = lambda: False,
) -> tuple[T | None, str | None]:
    """``call()`` (a GET or HEAD), retried on transient failures (503, transport
    errors, a corrupted body) until ``deadline`` or ``stop()``, 50 ms apart and then
    twice as long each time, up to 1 s. A 404 (``None``) and any other error are
    final. Returns the result, or ``None`` and why."""
    attempts = 0

    def delay(error: Exception, attempt: int) -> float | None:
        nonlocal attempts
        attempts = attempt
        wait = backoff(attempt, 0.05, 1.0)
        if not isinstance(error, _TRANSIENT) or time.monotonic() + wait >= deadline or stop():
            return None
        counters.add("load_retries")
        return wait

    try:
        result = retried(call, delay)
    except _TRANSIENT as exc:
        return None, f"{type(exc).__name__}: {exc} (after {attempts} attempts)"
    except Exception as exc:  # 4xx, a wrong shape, anything unexpected: final
        return None, f"{type(exc).__name__}: {exc}"
    if result is None:
        return None, "not found (404): evicted or deleted since the scheduler asked"
    return result, None


def check_shape(shape: tuple[int, ...], num_embeds: int | None, width: int | None) -> str | None:
    """Why an entry of ``shape`` is not the encoder output vLLM expects, or None."""
    if len(shape) < 1:
        return "a 0-d tensor"
    if num_embeds is not None and shape[0] != num_embeds:
        return f"shape {shape}, but vLLM expects {num_embeds} rows"
    if width is not None and len(shape) == 2 and shape[1] != width:
        return f"shape {shape}, but the encoder width is {width}"
    return None


class EntryClient(Protocol):
    """What the prefetcher needs of :class:`ec_cache.Client`."""

    def head(self, hash: str) -> EntryInfo | None: ...

    def get(self, hash: str, *, out: torch.Tensor | None = None) -> torch.Tensor | None: ...


@dataclass
class HostEntry:
    """One fetched entry in host memory: ``tensor`` is a view into ``lease`` (a pooled,
    pinned-where-CUDA buffer) or, without a staging pool, a tensor of its own."""

    tensor: torch.Tensor
    nbytes: int
    lease: PooledBuffer | None = None

    def to_device(self, device: torch.device) -> torch.Tensor:
        """The tensor on ``device``: a ``non_blocking`` copy on the current stream from
        a pinned buffer (the pool reuses the buffer only after it), else the tensor
        itself when it already is there."""
        if self.lease is not None:
            try:
                return copy_to_device(self.tensor, self.lease, device)
            finally:
                self.release()
        return self.tensor if self.tensor.device == device else self.tensor.to(device)

    def release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()


@dataclass(frozen=True)
class PrefetchReport:
    """What one worker holds (order ids), what failed since its previous report, and
    the bytes of host memory its prefetches take."""

    ready: frozenset[int]
    failed: frozenset[int]
    held_bytes: int


class _State(enum.Enum):
    QUEUED = "queued"
    FETCHING = "fetching"
    HELD = "held"


@dataclass
class _Job:
    order: PrefetchOrder
    deadline: float
    state: _State = _State.QUEUED
    cancelled: bool = False
    reserved: int = 0  # bytes of the budget this job takes
    entry: HostEntry | None = None
    held_since: float = 0.0
    started: float = field(default_factory=time.monotonic)


# A held entry neither taken nor released this many ``timeout_s`` after it arrived is
# dropped: a guard against a release that never came, not a part of the protocol
# (the scheduler releases what nobody waits for).
HELD_TTL_TIMEOUTS = 3


class Prefetcher:
    """Fetches ordered entries on ``threads`` daemon threads into host memory, at
    most ``budget_bytes`` at once (fetching and held; tensor bytes, a pooled buffer
    rounds up); each order must be held within ``timeout_s`` of its arrival (waiting
    for room included). ``staging``: the pool of (pinned) buffers to receive into;
    without it each entry gets a tensor of its own (CPU workers: handed to vLLM as
    it is)."""

    def __init__(
        self,
        client: EntryClient,
        *,
        dtype: torch.dtype,
        budget_bytes: int,
        threads: int,
        timeout_s: float,
        counters: Counters,
        staging: BufferPool | None = None,
    ) -> None:
        self._client = client
        self._dtype = dtype
        self._budget = budget_bytes
        self._threads_wanted = threads
        self._timeout = timeout_s
        self._counters = counters
        self._staging = staging
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}  # mm_hash -> job
        self._by_order: dict[int, _Job] = {}
        self._queue: collections.deque[_Job] = collections.deque()
        self._failed: set[int] = set()  # order ids, since the previous report
        self._used = 0  # bytes reserved by fetching and held jobs
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._failures_logged = 0

    @property
    def held_bytes(self) -> int:
        with self._cond:
            return self._used

    def submit(self, order: PrefetchOrder) -> None:
        """Fetch ``order``'s entry (an entry already known takes the new order id)."""
        with self._cond:
            if self._closed:
                return
            job = self._jobs.get(order.mm_hash)
            if job is not None:
                self._by_order.pop(job.order.order_id, None)
                job.order = order
                job.cancelled = False
                job.deadline = time.monotonic() + self._timeout
            else:
                job = _Job(order, time.monotonic() + self._timeout)
                self._jobs[order.mm_hash] = job
                self._queue.append(job)
                self._cond.notify()
            self._by_order[order.order_id] = job
            if len(self._threads) < self._threads_wanted:
                self._start_threads()

    def release(self, order_id: int) -> None:
        """Drop the entry of ``order_id``: held memory is freed now, a queued order
        never starts, a fetch in flight is dropped when it ends."""
        with self._cond:
            job = self._by_order.get(order_id)
            if job is not None:
                self._drop(job)

    def take(self, mm_hash: str, wait_until: float) -> HostEntry | None:
        """The held entry of ``mm_hash``, now owned by the caller; one still being
        fetched is waited for until ``wait_until``. ``None``: not held (the caller
        fetches it; a prefetch still under way then is dropped)."""
        with self._cond:
            job = self._jobs.get(mm_hash)
            while job is not None and job.state is not _State.HELD:
                remaining = wait_until - time.monotonic()
                if job.cancelled or remaining <= 0:
                    self._drop(job)
                    return None
                self._cond.wait(remaining)
                job = self._jobs.get(mm_hash)
            if job is None:
                return None
            entry = job.entry
            job.entry = None
            self._remove(job)
            return entry

    def report(self) -> PrefetchReport:
        """Held orders, failures since the previous report, bytes taken; fails queued
        orders past their deadline, drops held entries past ``HELD_TTL_TIMEOUTS``."""
        with self._cond:
            now = time.monotonic()
            held_ttl = HELD_TTL_TIMEOUTS * self._timeout
            for job in list(self._jobs.values()):
                if job.state is _State.HELD and now - job.held_since >= held_ttl:
                    self._counters.add("prefetch_held_expired")
                    self._remove(job)
                elif job.state is _State.QUEUED and now >= job.deadline:
                    self._fail(job, "still queued at its deadline (budget full)")
            held = [j.order.order_id for j in self._jobs.values() if j.state is _State.HELD]
            failed, self._failed = frozenset(self._failed), set()
            return PrefetchReport(frozenset(held), failed, self._used)

    def close(self) -> None:
        """Drop everything; the threads end (fetches in flight end with their timeouts)."""
        with self._cond:
            self._closed = True
            for job in list(self._jobs.values()):
                if job.state is _State.FETCHING:
                    job.cancelled = True
                else:
                    self._remove(job)
            self._cond.notify_all()

    # ---------------------------------------------------------------- threads

    def _start_threads(self) -> None:
        while len(self._threads) < self._threads_wanted:
            thread = threading.Thread(
                target=self._run, name=f"ec-cache-prefetch-{len(self._threads)}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                job.state = _State.FETCHING
            try:
                self._fetch(job)
            except Exception as exc:  # a bug must cost this entry, not the thread
                with self._cond:
                    self._give_up(job, f"{type(exc).__name__}: {exc}")

    def _fetch(self, job: _Job) -> None:
        order = job.order
        started = time.monotonic()
        shape, error = self._shape(job)
        if shape is None:
            with self._cond:
                self._give_up(job, error or "no shape")
            return
        nbytes = math.prod(shape) * self._dtype.itemsize
        if not self._reserve(job, nbytes):
            return
        entry = self._allocate(shape, nbytes)
        tensor, error = fetch_until(
            lambda: self._client.get(order.key, out=entry.tensor),
            job.deadline,
            self._counters,
            stop=lambda: job.cancelled or self._closed,
        )
        with self._cond:
            if tensor is None or job.cancelled or self._closed:
                entry.release()
                self._give_up(job, error or "not found")
            else:
                job.entry = entry
                job.state = _State.HELD
                job.held_since = time.monotonic()
                self._counters.add("prefetch_fetched")
                self._counters.add("prefetch_fetch_bytes", nbytes)
                self._counters.add("prefetch_fetch_seconds", job.held_since - started)
                self._cond.notify_all()

    def _shape(self, job: _Job) -> tuple[tuple[int, ...] | None, str | None]:
        """The entry's shape: the one vLLM expects when it knows the width, else what
        a ``HEAD`` says (checked before any memory is taken)."""
        order = job.order
        if order.num_embeds is not None and order.width is not None:
            return (order.num_embeds, order.width), None
        info, error = fetch_until(
            lambda: self._client.head(order.key),
            job.deadline,
            self._counters,
            stop=lambda: job.cancelled or self._closed,
        )
        if info is None:
            return None, error
        want = str(self._dtype).removeprefix("torch.")
        if info.dtype != want:
            return None, f"dtype {info.dtype}, but the namespace is {want}"
        wrong = check_shape(info.shape, order.num_embeds, order.width)
        return (None, wrong) if wrong else (info.shape, None)

    def _reserve(self, job: _Job, nbytes: int) -> bool:
        """Wait for ``nbytes`` of room in the budget until the job's deadline."""
        with self._cond:
            if nbytes > self._budget:
                self._fail(job, f"{nbytes} bytes do not fit prefetch_buffer_bytes ({self._budget})")
                return False
            waited = False
            while self._used + nbytes > self._budget:
                remaining = job.deadline - time.monotonic()
                if job.cancelled or self._closed or remaining <= 0:
                    break
                if not waited:
                    waited = True
                    self._counters.add("prefetch_budget_waits")
                self._cond.wait(remaining)
            if job.cancelled or self._closed or self._used + nbytes > self._budget:
                self._give_up(job, "no room in prefetch_buffer_bytes before the deadline")
                return False
            self._used += nbytes
            job.reserved = nbytes
            return True

    def _allocate(self, shape: tuple[int, ...], nbytes: int) -> HostEntry:
        if self._staging is None:
            return HostEntry(torch.empty(shape, dtype=self._dtype), nbytes)
        # Pinned memory stays within the budget: idle buffers go before a new one.
        if self.held_bytes + self._staging.stats()["idle_bytes"] > self._budget:
            self._staging.clear()
        lease = self._staging.acquire(nbytes)
        return HostEntry(typed_view(lease.tensor, nbytes, self._dtype, shape), nbytes, lease)

    # ------------------------------------------------------- under self._cond

    def _drop(self, job: _Job) -> None:
        if job.cancelled:
            return
        self._counters.add("prefetch_dropped")
        if job.state is _State.FETCHING:
            job.cancelled = True  # removed when the fetch ends
            self._by_order.pop(job.order.order_id, None)
        else:
            self._remove(job)

    def _give_up(self, job: _Job, why: str) -> None:
        """End ``job`` without an entry: dropped if it was released, else failed."""
        if job.cancelled or self._closed:
            self._remove(job)
        else:
            self._fail(job, why)

    def _fail(self, job: _Job, why: str) -> None:
        if self._jobs.get(job.order.mm_hash) is not job:
            return
        self._counters.add("prefetch_fetch_failed")
        self._failed.add(job.order.order_id)
        self._failures_logged += 1
        # The first failures in full, then one line per 100 to keep logs readable.
        if self._failures_logged <= 3 or self._failures_logged % 100 == 0:
            logger.warning(
                "ec-cache: prefetch of %s failed (%d failures so far); the encoder computes it: %s",
                job.order.mm_hash,
                self._failures_logged,
                why,
            )
        self._remove(job)

    def _remove(self, job: _Job) -> None:
        if self._jobs.get(job.order.mm_hash) is job:
            del self._jobs[job.order.mm_hash]
        if self._by_order.get(job.order.order_id) is job:
            del self._by_order[job.order.order_id]
        if job.state is _State.QUEUED and job in self._queue:
            self._queue.remove(job)
        if job.entry is not None:
            job.entry.release()
            job.entry = None
        self._used -= job.reserved
        job.reserved = 0
        self._cond.notify_all()
