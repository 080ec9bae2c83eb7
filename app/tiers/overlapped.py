"""A disk-tier write fed from the event loop: the file system works while the next
bytes arrive.

Used by a PUT (the body as it is received) and by a read-through fill (the backend's
body as it is read). Each hands batches to :meth:`OverlappedWrite.write`; the writer
threads write them to the temp file in order, one batch at a time, and batches handed
over meanwhile wait and go together as the next one. ``write`` returns at once while
at most ``behind`` bytes wait for the disk, else once the writes have caught up to that:

* a PUT passes 0: ``write`` returns as soon as the batch *before* is written, so
  receiving and writing overlap and at most two batches are held in memory;
* a fill passes the bytes it keeps in memory for its readers anyway: its readers are
  then served at the backend's pace, not at the disk's, and the fill still stops
  reading when the disk falls further behind than that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import anyio

from app.tiers.disk import PendingWrite


class OverlappedWrite:
    """``pending``'s temp file, created and written in the ``writer`` threads one batch
    at a time, in order; ``on_written`` (if any) is called on the event loop after each
    batch is written."""

    def __init__(
        self,
        pending: PendingWrite,
        writer: ThreadPoolExecutor,
        *,
        behind: int = 0,
        on_written: Callable[[], None] | None = None,
    ) -> None:
        self.pending = pending
        self._writer = writer
        self._behind = behind
        self._on_written = on_written
        #: The creation or batch being done in a writer thread.
        self._inflight: asyncio.Future[None] | None = None
        #: Handed over while another batch was being written: the next batch.
        self._waiting: list[bytes | bytearray | memoryview] = []
        self._waiting_bytes = 0
        self._error: BaseException | None = None
        self._stopped = False

    def create(self) -> None:
        """Start creating the file; the first batch is written once it exists."""
        self._start(self.pending.create)

    async def write(self, chunks: Sequence[bytes | bytearray | memoryview]) -> None:
        """Hand ``chunks`` over to be written after everything handed over before; wait
        while more than ``behind`` bytes wait for the disk. Raises what a write or the
        creation raised (507 for a full disk)."""
        self._raise_error()
        if self._inflight is None:
            self._start(self.pending.write, list(chunks))
            return
        self._waiting.extend(chunks)
        self._waiting_bytes += sum(len(chunk) for chunk in chunks)
        while self._waiting_bytes > self._behind and self._inflight is not None:
            await asyncio.wait([self._inflight])
        self._raise_error()

    async def flush(self) -> None:
        """Wait until everything handed over is written; raises as ``write``."""
        while self._inflight is not None:
            await asyncio.wait([self._inflight])
        self._raise_error()

    async def settle(self) -> None:
        """Write nothing more and wait, shielded and ignoring errors, until no creation
        or write is in flight: only then may the file be closed and removed (a
        descriptor closed under a write could be reused by another file)."""
        self._stopped = True
        self._waiting.clear()
        self._waiting_bytes = 0
        if self._inflight is not None:
            with anyio.CancelScope(shield=True):
                while self._inflight is not None:
                    await asyncio.wait([self._inflight])

    def _start(self, job: Callable[..., None], *args: object) -> None:
        inflight = asyncio.wrap_future(self._writer.submit(job, *args))
        inflight.add_done_callback(self._done)
        self._inflight = inflight

    def _done(self, inflight: asyncio.Future[None]) -> None:
        """On the event loop, when the writer thread is done with a job: start the
        batch that waited meanwhile. Runs before any task awaiting ``inflight`` wakes."""
        self._inflight = None
        error = asyncio.CancelledError() if inflight.cancelled() else inflight.exception()
        if error is not None:
            self._error = error
            self._stopped = True
            self._waiting.clear()
            self._waiting_bytes = 0
            return
        if self._on_written is not None:
            self._on_written()
        if self._waiting and not self._stopped:
            batch, self._waiting, self._waiting_bytes = self._waiting, [], 0
            self._start(self.pending.write, batch)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error
