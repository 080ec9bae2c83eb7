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
import functools
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
from ec_cache._vllm.logs import logger
from ec_cache._vllm.planner import PrefetchOrder
from ec_cache._vllm.shapes import check_shape

__all__ = ["HostEntry", "PrefetchReport", "Prefetcher", "fetch_until"]

T = TypeVar("T")

# Failures that a later attempt may not meet: 503, transport errors, a corrupted body.
# Not a timeout: each call is given all the time left (or its body was too slow).
_TRANSIENT = (ec_cache.UnavailableError, ec_cache.TransportError, ec_cache.IntegrityError)


def fetch_until(
    call: Callable[[], T | None],
    deadline: float,
    counters: Counters,
    stop: Callable[[], bool] = lambda: False,
) -> tuple[T | None, str | None]:
    """``call()`` (a GET or HEAD), retried on transient failures (503, transport
    errors but timeouts, a corrupted body) until ``deadline`` or ``stop()``, 50 ms
    apart and then twice as long each time, up to 1 s. A 404 (``None``), a timeout
    and any other error are final. Returns the result, or ``None`` and why."""
    attempts = 0

    def delay(error: Exception, attempt: int) -> float | None:
        nonlocal attempts
        attempts = attempt
        wait = backoff(attempt, 0.05, 1.0)
        if (
            not isinstance(error, _TRANSIENT)
            or isinstance(error, ec_cache.TransportTimeout)
            or time.monotonic() + wait >= deadline
            or stop()
        ):
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


class EntryClient(Protocol):
    """What the prefetcher needs of :class:`ec_cache.Client`."""

    def head(
        self, hash: str, *, timeout: float | None = None, stop: Callable[[], bool] | None = None
    ) -> EntryInfo | None: ...

    def get(
        self,
        hash: str,
        *,
        out: torch.Tensor | None = None,
        timeout: float | None = None,
        stop: Callable[[], bool] | None = None,
        min_rate: float | None = None,
    ) -> torch.Tensor | None: ...


@dataclass
class HostEntry:
    """One fetched entry in host memory: ``tensor`` is a view into ``lease`` (a pooled,
    pinned-where-CUDA buffer) or, without a staging pool, a tensor of its own.
    ``on_release``: called once the lease went back (the budget gets its bytes)."""

    tensor: torch.Tensor
    nbytes: int
    lease: PooledBuffer | None = None
    on_release: Callable[[], None] | None = None

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
        on_release, self.on_release = self.on_release, None
        if lease is not None:
            lease.release()
        if on_release is not None:
            on_release()


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
    abandoned: bool = False  # released, taken elsewhere or closed: its fetch stops
    reserved: int = 0  # bytes of the budget this job takes
    entry: HostEntry | None = None
    held_since: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def stop(self) -> bool:
        return self.abandoned


# A staging buffer up to this many times an entry's size is reused for it (the
# budget counts the whole buffer): a new pinned buffer costs far more than a copy.
REUSE_UP_TO = 4.0

# A held entry neither taken nor released this many ``timeout_s`` after it arrived is
# dropped: a guard against a release that never came, not a part of the protocol
# (the scheduler releases what nobody waits for).
HELD_TTL_TIMEOUTS = 3


class Prefetcher:
    """Fetches ordered entries on ``threads`` daemon threads into host memory, at
    most ``budget_bytes`` at once: the memory really taken, so a pooled buffer counts
    its capacity, and the pool's idle buffers count too (they are dropped, the largest
    first, to make room). Each order must be held within ``timeout_s`` of its arrival
    (waiting for room included); a fetch ends at that deadline wherever it is (the
    SDK bounds the whole transfer, not each receive), or sooner when its body
    arrives slower than ``min_rate`` bytes per second. ``staging``: the pool of
    (pinned) buffers to receive into; without it each entry gets a tensor of its own
    (CPU workers: handed to vLLM as it is). ``on_failure(key)``: an entry could not be
    fetched (its key is no longer known to be present)."""

    def __init__(
        self,
        client: EntryClient,
        *,
        dtype: torch.dtype,
        budget_bytes: int,
        threads: int,
        timeout_s: float,
        counters: Counters,
        min_rate: float | None = None,
        on_failure: Callable[[str], None] = lambda key: None,
        staging: BufferPool | None = None,
    ) -> None:
        self._client = client
        self._dtype = dtype
        self._budget = budget_bytes
        self._threads_wanted = threads
        self._timeout = timeout_s
        self._min_rate = min_rate
        self._counters = counters
        self._on_failure = on_failure
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
        """Drop the entry of ``order_id`` now: held memory is freed, a queued order
        never starts, a fetch in flight is abandoned: its bytes leave the budget at
        once, and its transfer stops (its thread takes the next order) within the
        SDK's stop poll, 50 ms."""
        with self._cond:
            job = self._by_order.get(order_id)
            if job is not None:
                self._counters.add("prefetch_dropped")
                self._abandon(job)

    def take(self, mm_hash: str, wait_until: float) -> HostEntry | None:
        """The held entry of ``mm_hash``, now owned by the caller; one still being
        fetched is waited for until ``wait_until``. ``None``: not held (the caller
        fetches it; a prefetch still under way then is abandoned)."""
        with self._cond:
            job = self._jobs.get(mm_hash)
            while job is not None and job.state is not _State.HELD:
                remaining = wait_until - time.monotonic()
                if remaining <= 0:
                    self._counters.add("prefetch_dropped")
                    self._abandon(job)
                    return None
                self._cond.wait(remaining)
                job = self._jobs.get(mm_hash)
            if job is None:
                return None
            entry = job.entry
            job.entry = None
            if entry is not None and entry.lease is not None:
                # The caller holds the buffer until its copy is done: the budget
                # gets the bytes back then.
                entry.on_release = functools.partial(self._unreserve, job.reserved)
                job.reserved = 0
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
        """Drop everything; the threads end (fetches in flight stop within 50 ms)."""
        with self._cond:
            self._closed = True
            for job in list(self._jobs.values()):
                self._abandon(job)
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
        entry = self._allocate(job, shape, nbytes)
        tensor, error = fetch_until(
            lambda: self._client.get(
                order.key,
                out=entry.tensor,
                timeout=job.deadline - time.monotonic(),
                stop=job.stop,
                min_rate=self._min_rate,
            ),
            job.deadline,
            self._counters,
            stop=job.stop,
        )
        with self._cond:
            if tensor is None or job.abandoned:
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
            lambda: self._client.head(
                order.key, timeout=job.deadline - time.monotonic(), stop=job.stop
            ),
            job.deadline,
            self._counters,
            stop=job.stop,
        )
        if info is None:
            return None, error
        want = str(self._dtype).removeprefix("torch.")
        if info.dtype != want:
            return None, f"dtype {info.dtype}, but the namespace is {want}"
        wrong = check_shape(info.shape, order.num_embeds, order.width)
        return (None, wrong) if wrong else (info.shape, None)

    def _reserve(self, job: _Job, nbytes: int) -> bool:
        """Wait for room for ``nbytes`` (a new pooled buffer's capacity) in the budget
        until the job's deadline (idle pooled buffers are dropped for it, if need be,
        when no idle one is reused)."""
        need = self._staging.capacity_for(nbytes) if self._staging is not None else nbytes
        with self._cond:
            if need > self._budget:
                self._fail(job, f"{need} bytes do not fit prefetch_buffer_bytes ({self._budget})")
                return False
            waited = False
            while self._used + need > self._budget:
                remaining = job.deadline - time.monotonic()
                if job.abandoned or remaining <= 0:
                    break
                if not waited:
                    waited = True
                    self._counters.add("prefetch_budget_waits")
                self._cond.wait(remaining)
            if job.abandoned or self._used + need > self._budget:
                self._give_up(job, "no room in prefetch_buffer_bytes before the deadline")
                return False
            self._used += need
            job.reserved = need
            return True

    def _allocate(self, job: _Job, shape: tuple[int, ...], nbytes: int) -> HostEntry:
        staging = self._staging
        if staging is None:
            return HostEntry(torch.empty(shape, dtype=self._dtype), nbytes)
        lease = staging.reuse(nbytes, up_to=REUSE_UP_TO)
        if lease is None:  # a new buffer: idle ones go first, so that the budget holds
            with self._cond:
                staging.trim(self._budget - self._used)
            lease = staging.acquire(nbytes)
        with self._cond:  # a reused idle buffer may be larger: it moved out of idle
            if job.reserved:
                self._used += lease.capacity - job.reserved
                job.reserved = lease.capacity
        return HostEntry(typed_view(lease.tensor, nbytes, self._dtype, shape), nbytes, lease)

    # ------------------------------------------------------- under self._cond

    def _abandon(self, job: _Job) -> None:
        """Forget ``job`` now (its bytes leave the budget); a fetch in flight sees
        ``job.stop()`` and ends."""
        job.abandoned = True
        self._remove(job)

    def _give_up(self, job: _Job, why: str) -> None:
        """End ``job`` without an entry: failed unless it was abandoned."""
        if job.abandoned or self._closed:
            self._remove(job)
        else:
            self._fail(job, why)

    def _fail(self, job: _Job, why: str) -> None:
        if self._jobs.get(job.order.mm_hash) is not job:
            return
        self._counters.add("prefetch_fetch_failed")
        self._failed.add(job.order.order_id)
        self._on_failure(job.order.key)
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

    def _unreserve(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()

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
