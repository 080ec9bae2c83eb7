"""A disk-tier write fed from the event loop: the file system works while the next
bytes arrive.

Used by a PUT (the body as it is received) and by a read-through fill (the backend's
body as it is read): each hands batches to :meth:`OverlappedWrite.write`, which returns
as soon as the batch *before* is on its way, so receiving and writing overlap and at most
two batches are held in memory per write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import anyio

from app.tiers.disk import PendingWrite


class OverlappedWrite:
    """``pending``'s temp file, created and written in the ``writer`` threads one batch
    at a time, in order."""

    def __init__(self, pending: PendingWrite, writer: ThreadPoolExecutor) -> None:
        self.pending = pending
        self._writer = writer
        self._inflight: Future[None] | None = None

    def create(self) -> None:
        """Start creating the file; the first write waits for it."""
        self._inflight = self._writer.submit(self.pending.create)

    async def write(self, chunks: Sequence[bytes | memoryview]) -> None:
        """Start writing ``chunks`` once the batch before them is written."""
        await self.flush()
        self._inflight = self._writer.submit(self.pending.write, chunks)

    async def flush(self) -> None:
        """Wait for the file's creation or the batch being written; raises what that
        raised (507 for a full disk)."""
        if self._inflight is not None:
            await asyncio.wrap_future(self._inflight)
            self._inflight = None

    async def settle(self) -> None:
        """Wait, shielded and ignoring errors, until neither the file's creation nor a
        write is in flight: only then may the file be closed and removed (a descriptor
        closed under a write could be reused by another file)."""
        if self._inflight is not None and not self._inflight.done():
            with anyio.CancelScope(shield=True):
                await asyncio.wait([asyncio.wrap_future(self._inflight)])
