"""Background upload of encoder outputs: a bounded queue drained by daemon threads.

The forward pass only enqueues (a host copy, see :mod:`ec_cache.vllm`); the network
work happens here. When the cache is slower than the encoder the queue fills up and
new jobs are dropped and counted: an encoder output that is not cached is only a
future miss, never a reason to stall inference or grow memory without bound.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ec_cache._vllm.counters import Counters
from ec_cache._vllm.logs import logger

__all__ = ["BackgroundUploader", "UploadJob"]


@dataclass
class UploadJob:
    """One tensor to upload under ``key``.

    ``tensor`` is a host tensor that nobody else writes to (a pinned staging copy or
    a clone). ``ready``, when set, is called on the upload thread before the tensor
    is read: it waits for the device-to-host copy (a CUDA event's ``synchronize``).
    """

    key: str
    tensor: Any
    nbytes: int
    ready: Callable[[], None] | None = None
    enqueued_at: float = field(default_factory=time.monotonic)


class BackgroundUploader:
    """Uploads :class:`UploadJob` s with ``put(key, tensor) -> created`` on
    ``threads`` daemon threads, holding at most ``max_items`` jobs and ``max_bytes``
    bytes queued (jobs being uploaded count too)."""

    def __init__(
        self,
        put: Callable[[str, Any], bool],
        *,
        counters: Counters,
        max_items: int = 64,
        max_bytes: int = 1 << 30,
        threads: int = 2,
        name: str = "ec-cache-upload",
    ) -> None:
        if max_items < 1 or max_bytes < 1 or threads < 1:
            raise ValueError("max_items, max_bytes and threads must be >= 1")
        self._put = put
        self._counters = counters
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._queue: collections.deque[UploadJob] = collections.deque()
        self._cond = threading.Condition()
        self._pending_items = 0  # queued + in flight
        self._pending_bytes = 0
        self._closed = False
        self._failures_logged = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: UploadJob) -> bool:
        """Queue ``job``; ``False`` (and ``save_dropped`` counted) when the queue is
        full or closed. Never blocks."""
        with self._cond:
            full = (
                self._closed
                or self._pending_items >= self._max_items
                or (self._pending_items > 0 and self._pending_bytes + job.nbytes > self._max_bytes)
            )
            if not full:
                self._queue.append(job)
                self._pending_items += 1
                self._pending_bytes += job.nbytes
                self._cond.notify()
        if full:
            self._counters.add("save_dropped")
            self._counters.add("save_dropped_bytes", job.nbytes)
            return False
        self._counters.add("save_enqueued")
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is done; ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending_items:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop taking jobs, finish the queued ones within ``timeout`` seconds, then
        drop (and count) whatever is left."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            left = len(self._queue)
            dropped_bytes = sum(job.nbytes for job in self._queue)
            self._queue.clear()
            self._pending_items -= left
            self._pending_bytes -= dropped_bytes
            self._cond.notify_all()
        if left:
            self._counters.add("save_dropped", left)
            self._counters.add("save_dropped_bytes", dropped_bytes)
        for thread in self._threads:
            thread.join(timeout=0.5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
            try:
                self._upload(job)
            finally:
                with self._cond:
                    self._pending_items -= 1
                    self._pending_bytes -= job.nbytes
                    self._cond.notify_all()

    def _upload(self, job: UploadJob) -> None:
        started = time.monotonic()
        self._counters.add("save_queue_seconds", started - job.enqueued_at)
        try:
            if job.ready is not None:
                job.ready()
            created = self._put(job.key, job.tensor)
        except Exception as exc:  # the uploader must survive any failure
            self._counters.add("save_failed")
            self._failures_logged += 1
            # First failures in full, then one line per 100 to keep logs readable.
            if self._failures_logged <= 3 or self._failures_logged % 100 == 0:
                logger.warning(
                    "ec-cache: upload of %s failed (%d failures so far): %s",
                    job.key,
                    self._failures_logged,
                    exc,
                )
            return
        finally:
            job.tensor = None  # release the staging buffer as soon as possible
        self._counters.add("save_seconds", time.monotonic() - started)
        if created:
            self._counters.add("save_created")
            self._counters.add("save_bytes", job.nbytes)
        else:
            self._counters.add("save_present")
