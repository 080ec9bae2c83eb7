"""An upload's deadlines, kept by one timer per upload rather than one per chunk.

A 4.7 MB body reaches the app in 20-30 chunks. A cancel scope around each chunk's wait
(``anyio.move_on_after``) took about a tenth of the event loop's time with 16 uploads in
flight (py-spy): each one looks up the backend and the task, and arms and cancels a
timer. Here a chunk only notes the time and the byte count; one timer, armed when the
first wait begins, re-arms itself for the next deadline whenever it fires early, and
cancels the task only while it waits for the client. Time the server spends on a chunk
(checksum, disk) counts towards no idle deadline, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from app.errors import SlowClient
from app.settings import Settings


async def with_deadlines(chunks: AsyncIterator[bytes], settings: Settings) -> AsyncIterator[bytes]:
    """Pass an upload's chunks through; raise ``SlowClient`` when the client stalls.

    Three rules, each answered 408 (the store then removes its temp file): no chunk for
    ``EC_BODY_READ_TIMEOUT``; fewer than ``EC_UPLOAD_MIN_RATE`` bytes per second since
    the end of ``EC_UPLOAD_RATE_GRACE`` (so a client trickling a byte a second cannot
    hold an upload slot); the whole body later than ``EC_UPLOAD_TIMEOUT``.
    """
    watch = _Watch(settings)
    iterator = aiter(chunks)
    try:
        while True:
            watch.waiting_since = watch.loop.time()
            if watch.timer is None:
                watch.arm()
            try:
                chunk = await anext(iterator)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if watch.expired is None:
                    raise
                watch.task.uncancel()
                raise SlowClient(watch.expired) from None
            finally:
                watch.waiting_since = None
            watch.received += len(chunk)
            yield chunk
    finally:
        watch.disarm()


class _Watch:
    """The state of one upload, read by its timer on the event loop."""

    def __init__(self, settings: Settings) -> None:
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "an upload is read by a task"
        self.task = task
        self.start = self.loop.time()
        self.received = 0
        #: While the task waits for the next chunk: when that wait began.
        self.waiting_since: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        #: Why the upload was cut off, once the timer has cancelled its wait.
        self.expired: str | None = None
        self._idle = settings.body_read_timeout
        self._total = settings.upload_timeout
        self._rate = settings.upload_min_rate
        self._grace = settings.upload_rate_grace

    def arm(self) -> None:
        self.timer = self.loop.call_at(self._next_deadline()[0], self._fire)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _next_deadline(self) -> tuple[float, str]:
        deadline = (self.start + self._total, f"upload took over {self._total:g} s")
        if self.waiting_since is not None:
            idle = (self.waiting_since + self._idle, f"no body bytes received for {self._idle:g} s")
            deadline = min(deadline, idle)
        if self._rate:
            # The moment the average since the grace period falls below the rate.
            rate = (
                self.start + self._grace + self.received / self._rate,
                f"upload slower than {self._rate} bytes/s (after a {self._grace:g} s grace period)",
            )
            deadline = min(deadline, rate)
        return deadline

    def _fire(self) -> None:
        self.timer = None
        if self.waiting_since is None:
            return  # the server is busy with a chunk: the next wait re-arms
        now = self.loop.time()
        deadline, reason = self._next_deadline()
        if now < deadline:
            self.timer = self.loop.call_at(deadline, self._fire)
            return
        self.expired = f"{reason}: {self.received} bytes in {now - self.start:.1f} s"
        self.task.cancel()
