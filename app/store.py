"""The store: answers entry requests by asking the tiers in order.

Routes talk only to this class. It validates bodies as they stream in, decides which
tier answers, and keeps slow file work off the event loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import anyio.to_thread

from app.errors import NotFound
from app.keys import EntryKey
from app.metrics import Metrics
from app.safetensors_format import BodyValidator
from app.settings import Settings
from app.tiers.base import EntryBody, EntryInfo
from app.tiers.disk import DiskTier

#: Received chunks are batched into writes of about this size (one thread hop each).
WRITE_BATCH_BYTES = 1024 * 1024


@dataclass(frozen=True)
class PutResult:
    created: bool
    size: int
    crc32c: int


class Store:
    def __init__(self, settings: Settings, disk: DiskTier, metrics: Metrics) -> None:
        self.settings = settings
        self.disk = disk
        self.metrics = metrics

    async def start(self) -> None:
        await anyio.to_thread.run_sync(self.disk.rebuild)

    async def stop(self) -> None:
        """Release resources; the disk tier needs nothing."""

    # -- reads --------------------------------------------------------------------

    async def _open_disk(self, key: EntryKey) -> EntryBody | None:
        opened = self.disk.open(key)
        if opened is not None and not opened.verified:
            opened = await anyio.to_thread.run_sync(self.disk.verify, opened)
        return opened.body() if opened is not None else None

    async def get(self, key: EntryKey) -> EntryBody:
        body = await self._open_disk(key)
        if body is None:
            self.metrics.lookups.labels("miss").inc()
            raise NotFound(f"no entry {key}")
        self.metrics.lookups.labels(body.info.tier).inc()
        return body

    async def head(self, key: EntryKey) -> EntryInfo:
        info = self.disk.info(key)
        if info is None:
            body = await self._open_disk(key)
            info = body.info if body is not None else None
        if info is None:
            self.metrics.lookups.labels("miss").inc()
            raise NotFound(f"no entry {key}")
        self.metrics.lookups.labels(info.tier).inc()
        return info

    async def exists(self, key: EntryKey) -> bool:
        return self.disk.contains(key)

    async def exists_many(self, keys: Sequence[EntryKey]) -> list[bool]:
        return [self.disk.contains(key) for key in keys]

    # -- writes -------------------------------------------------------------------

    async def put(
        self,
        key: EntryKey,
        body: AsyncIterator[bytes],
        *,
        declared_length: int | None,
        expected_crc: int | None,
    ) -> PutResult:
        """Stream ``body`` into a temp file, validating as it goes, then commit it.

        Raises before the body is fully read when it is known to be bad; nothing is
        left behind on any error, including the client going away.
        """
        validator = BodyValidator(
            key.dtype,
            max_bytes=self.settings.max_body_bytes,
            expected_crc=expected_crc,
            declared_length=declared_length,
        )
        pending = await anyio.to_thread.run_sync(self.disk.begin_write, key, declared_length)
        try:
            batch: list[bytes] = []
            batched = 0
            async for chunk in body:
                validator.feed(chunk)
                batch.append(chunk)
                batched += len(chunk)
                if batched >= WRITE_BATCH_BYTES:
                    await anyio.to_thread.run_sync(pending.write, batch)
                    batch, batched = [], 0
            if batch:
                await anyio.to_thread.run_sync(pending.write, batch)
            header = validator.finish()
            created = await anyio.to_thread.run_sync(pending.commit, validator.crc, header)
        finally:
            # Also runs on cancellation (client gone): remove the temp file at once.
            with contextlib.suppress(OSError):
                pending.abort()
        if created:
            self.metrics.bytes_received.inc(validator.received)
        return PutResult(created, validator.received, validator.crc)

    async def delete(self, key: EntryKey) -> None:
        await anyio.to_thread.run_sync(self.disk.delete, key)

    # -- operations ---------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """A JSON summary for operators (``GET /stats``, ``ec-cache stats``)."""
        lookups = {
            result: int(
                self.metrics.registry.get_sample_value("ec_cache_lookups_total", {"result": result})
                or 0
            )
            for result in ("disk", "s3", "miss")
        }
        return {
            "disk": asdict(self.disk.stats()),
            "lookups": lookups,
            "write_mode": self.settings.write_mode.value,
            "s3_configured": self.settings.s3_enabled,
        }

    async def readiness(self) -> dict[str, str]:
        """Check name -> "ok" or the reason it failed."""
        return {"disk": await anyio.to_thread.run_sync(_check_writable, self.disk)}


def _check_writable(disk: DiskTier) -> str:
    try:
        pending = disk.begin_write(EntryKey("_readyz", "uint8", "probe"))
        pending.abort()
    except OSError as exc:
        return f"disk tier at {disk.root} is not writable: {exc.strerror}"
    return "ok"
