"""Write-through with the upload overlapping the receive.

A write-through PUT answers 201 only once the disk tier and the backend both hold the
verified bytes. Receiving the whole body first and uploading it afterwards costs the
client the receive plus the upload; here the backend upload starts as soon as the
safetensors header has arrived and is fed the same chunks the disk tier is written
with, so the PUT costs about the upload alone (``Backend.begin_put``).

That needs the body's length and CRC32C before its first byte (``Content-Length`` and
``X-EC-CRC32C``, which the SDK always sends): the backend verifies that CRC32C over what
it receives. The contract is kept by the order of events:

* **first writer wins**: the backend is asked whether it holds the entry (unless the
  route has just asked, for ``If-None-Match: *``) before the upload starts; when it
  does, nothing is uploaded and nothing is committed (200). Writers racing past that
  question are settled by the backend itself (S3's conditional write): ``finish``
  answers False to all but the first, which commit nothing either (200);
* **nothing half-stored**: the backend holds the last bytes back until the store has
  verified the whole body (length, safetensors header, CRC32C) and calls ``finish``; a
  mismatch, a client that goes away, or any other error calls ``abort`` instead, which
  withdraws the body (S3 keeps nothing of a single PUT whose body never completed), and
  the store removes the temp file;
* **disk last**: the temp file is committed only after ``finish`` returned.

Bodies the backend will not stream (at or above the multipart threshold) go up from the
committed temp file as before (``Backend.put_file``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from app.keys import EntryKey
from app.safetensors_format import TensorHeader
from app.tiers.base import Backend, RemotePut


class WriteThrough:
    """One write-through PUT's backend side; see the module docstring."""

    def __init__(
        self, backend: Backend, key: EntryKey, size: int, crc32c: int, *, known_absent: bool
    ) -> None:
        self.backend = backend
        self.key = key
        self.size = size
        self.crc32c = crc32c
        #: The first-writer check, running while the first bytes arrive.
        self._present: asyncio.Future[bool] | None = (
            None if known_absent else asyncio.ensure_future(backend.contains(key))
        )
        self._early: list[bytes | memoryview] = []
        self._decided = False
        #: The backend already holds the entry: nothing is uploaded or committed.
        self.exists = False
        #: The streaming upload (None: not started, or not streamed for this size).
        self.upload: RemotePut | None = None

    async def feed(self, chunks: Sequence[bytes | memoryview], header: TensorHeader | None) -> None:
        """Chunks just received; ``header`` once the safetensors header is parsed."""
        if not self._decided:
            if header is None:
                self._early.extend(chunks)
                return
            self._decided = True
            if self._present is not None:
                self.exists = await self._present
            if self.exists:
                return
            self.upload = self.backend.begin_put(self.key, self.size, self.crc32c, header)
            chunks = [*self._early, *chunks]
            self._early = []
        if self.upload is not None:
            await self.upload.feed(chunks)

    async def present(self) -> bool:
        """Whether the backend held the entry before this PUT (for the commit)."""
        if self._present is not None and not self._decided:
            self.exists = await self._present
        return self.exists

    async def finish(self) -> bool:
        """The whole body was verified: let the upload complete (raises if it failed);
        False when the backend refused it, holding another body of the key already."""
        upload, self.upload = self.upload, None
        return upload is None or await upload.finish()

    async def abort(self) -> None:
        """Withdraw whatever was started; safe to call at any point, also twice."""
        upload, self.upload = self.upload, None
        if upload is not None:
            await upload.abort()
        present = self._present
        if present is not None and not present.done():
            present.cancel()
        if present is not None and present.done() and not present.cancelled():
            present.exception()  # retrieved: no "never retrieved" warning
