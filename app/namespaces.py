"""Namespaces (model, dtype): usage, listing page by page, and purge of a model.

A purge removes every entry of a model (of one dtype, or of all) from this replica's
disk and from S3, where the objects lie under ``{prefix}/{model}/{dtype}/`` and go by
batched ``DeleteObjects`` of up to 1000 keys. It runs in the background and is

* **journaled**: ``{data_dir}/purges/{id}.json`` records the job and its S3 cursor
  (the last key deleted) after every batch, so a server that crashed resumes the job
  at start-up where it stopped;
* **idempotent**: purging what is gone deletes nothing; a second request for a running
  job answers that job;
* **safe under traffic**: while it runs, reads of the namespace are misses, writes
  answer 503 with ``Retry-After`` and pending write-back uploads of it are dropped (no
  new one starts); those in flight are waited for before its objects are deleted, and
  owe a journaled delete of their own (``app.tiers.upload_scheduler``), so nothing of the
  namespace is served, written back or re-filled behind the purge; other namespaces are
  not touched. S3 failures are retried with backoff (the job stays ``running`` and says
  why in ``last_error``);
* **reported**: entries and bytes removed from disk, objects deleted from S3, the cursor,
  timestamps (``GET /namespaces/purges``).

Disk entries whose key is unknown (see ``app.tiers.disk.keys_log``) go with any purge. Every
replica has its own disk: run the purge on each (``ec-cache purge`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread

from app.errors import ECError
from app.keys import DTYPES, EntryKey
from app.retries import backoff
from app.tiers.base import BackendAdmin, RemoteTier
from app.tiers.disk import DiskTier
from app.tiers.disk.file_sync import write_durably
from app.tiers.read_through import ReadThrough
from app.write_policy import WritePolicy

log = logging.getLogger(__name__)

PURGE_BATCH = 1000
RETRY_MIN, RETRY_MAX = 1.0, 60.0
#: Finished purge records kept for reporting.
KEEP_FINISHED = 50
S3_DESCRIBE_CONCURRENCY = 16
SUFFIX = ".safetensors"


def purge_id(model: str, dtype: str | None) -> str:
    return hashlib.sha256(f"{model}\n{dtype or '*'}".encode()).hexdigest()[:24]


@dataclass
class PurgeJob:
    """One purge and its progress (the journal record, and what the API reports)."""

    id: str
    model: str
    dtype: str | None  # None: every dtype
    state: str = "running"  # running | done
    started_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    disk_entries: int = 0
    disk_bytes: int = 0
    s3_objects: int = 0
    s3_bytes: int = 0
    #: Where S3 deletion resumes: the dtype being purged and the last key deleted.
    s3_dtype: str | None = None
    s3_after: str | None = None
    attempts: int = 0
    last_error: str | None = None

    def covers(self, model: str, dtype: str) -> bool:
        return self.state == "running" and model == self.model and self.dtype in (None, dtype)

    def public(self) -> dict[str, Any]:
        return asdict(self)


class Purges:
    """The purge jobs of one server: journal, background tasks, the namespace guard."""

    def __init__(
        self,
        data_dir: Path,
        disk: DiskTier,
        s3: RemoteTier | None,
        read_through: ReadThrough | None,
        writes: WritePolicy,
    ) -> None:
        self.directory = data_dir / "purges"
        self.disk = disk
        self.s3 = s3
        self.read_through = read_through
        self.writes = writes
        self.jobs: dict[str, PurgeJob] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # (model, dtype or None) of running jobs: checked on every entry request.
        self._active: set[tuple[str, str | None]] = set()
        #: Test hook: awaited before each S3 batch is deleted.
        self.before_batch: Callable[[PurgeJob], Any] | None = None

    # -- the guard the store asks on every request -----------------------------------

    def blocks(self, key: EntryKey) -> bool:
        """True while a running purge covers the key's namespace."""
        active = self._active
        return bool(active) and ((key.model, key.dtype) in active or (key.model, None) in active)

    # -- life cycle ------------------------------------------------------------------

    def load(self) -> None:
        """Read the journal (before the server takes traffic)."""
        for path in self.directory.glob("*.json") if self.directory.is_dir() else ():
            try:
                job = PurgeJob(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("ignoring unreadable purge record %s: %s", path, exc)
                continue
            self.jobs[job.id] = job
            if job.state == "running":
                self._active.add((job.model, job.dtype))

    async def start(self) -> None:
        """Resume the purges a crash or restart interrupted."""
        for job in list(self.jobs.values()):
            if job.state == "running":
                log.info("resuming purge of %s (%s)", job.model, job.dtype or "every dtype")
                self._spawn(job)

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- requests --------------------------------------------------------------------

    async def request(self, model: str, dtype: str | None) -> tuple[PurgeJob, bool]:
        """Start a purge, or return the running one for the same namespace; True when
        this call started it."""
        job_id = purge_id(model, dtype)
        job = self.jobs.get(job_id)
        if job is not None and job.state == "running":
            return job, False
        job = PurgeJob(job_id, model, dtype)
        self.jobs[job_id] = job
        self._active.add((model, dtype))
        await anyio.to_thread.run_sync(self._save, job)  # durable before it is reported
        self._spawn(job)
        self._forget_old()
        return job, True

    def listing(self) -> list[PurgeJob]:
        return sorted(self.jobs.values(), key=lambda job: job.started_at, reverse=True)

    # -- the work --------------------------------------------------------------------

    def _spawn(self, job: PurgeJob) -> None:
        task = asyncio.create_task(self._run(job), name=f"purge {job.model}")
        self._tasks[job.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job.id, None))

    async def _run(self, job: PurgeJob) -> None:
        failures = 0  # in this run (job.attempts counts those before a restart too)
        while True:
            job.attempts += 1
            try:
                await self._purge(job)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                delay = backoff(failures, RETRY_MIN, RETRY_MAX)
                job.last_error = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "purge of %s: %s (retrying in %.0f s)", job.model, job.last_error, delay
                )
                with contextlib.suppress(OSError):
                    await anyio.to_thread.run_sync(self._save, job)
                await asyncio.sleep(delay)
        job.state = "done"
        job.finished_at = job.updated_at = time.time()
        job.last_error = None
        self._active.discard((job.model, job.dtype))
        await anyio.to_thread.run_sync(self._save, job)
        log.info(
            "purge of %s (%s) done: %d disk entries (%d bytes), %d S3 objects",
            job.model,
            job.dtype or "every dtype",
            job.disk_entries,
            job.disk_bytes,
            job.s3_objects,
        )

    async def _purge(self, job: PurgeJob) -> None:
        await self._settle_uploads(job)
        await self._purge_disk(job)
        if self.s3 is not None:
            dtypes = [job.dtype] if job.dtype is not None else list(DTYPES)
            start = dtypes.index(job.s3_dtype) if job.s3_dtype in dtypes else 0
            for dtype in dtypes[start:]:
                if job.s3_dtype != dtype:
                    job.s3_dtype, job.s3_after = dtype, None
                await self._purge_s3_prefix(self.s3, job, dtype)
            await self._settle_fills(job)
            await self._settle_uploads(job)
            await self._purge_disk(job)  # what a fill in flight committed meanwhile

    async def _settle_uploads(self, job: PurgeJob) -> None:
        """Drop the namespace's write-back uploads; wait for those in flight, whose
        objects owe a journaled delete: what they store is in S3 before the namespace's
        objects are deleted, and deleted again on its own if need be."""
        await self.writes.before_purge(job.covers)

    async def _purge_disk(self, job: PurgeJob) -> None:
        entries, nbytes = await anyio.to_thread.run_sync(self.disk.purge, job.model, job.dtype)
        job.disk_entries += entries
        job.disk_bytes += nbytes
        job.updated_at = time.time()

    async def _purge_s3_prefix(self, s3: BackendAdmin, job: PurgeJob, dtype: str) -> None:
        prefix = s3.namespace_prefix(job.model, dtype)
        while True:
            objects, marker = await s3.list_page(
                prefix, start_after=job.s3_after, limit=PURGE_BATCH
            )
            batch = [(key, size) for key, size in objects if key.endswith(SUFFIX)]
            if self.before_batch is not None:
                await self.before_batch(job)
            await s3.delete_many([key for key, _ in batch])
            job.s3_objects += len(batch)
            job.s3_bytes += sum(size for _, size in batch)
            if objects:
                job.s3_after = objects[-1][0]
            if marker is not None:
                job.s3_after = marker
            job.updated_at = time.time()
            await anyio.to_thread.run_sync(self._save, job)
            if marker is None:
                return

    async def _settle_fills(self, job: PurgeJob) -> None:
        if self.read_through is None:
            return
        for key in self.read_through.filling():
            if job.covers(key.model, key.dtype):
                await self.read_through.settle(key)

    # -- journal ---------------------------------------------------------------------

    def _save(self, job: PurgeJob) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        write_durably(self.directory / f"{job.id}.json", json.dumps(job.public()).encode())

    def _forget_old(self) -> None:
        finished = sorted(
            (job for job in self.jobs.values() if job.state != "running"),
            key=lambda job: job.finished_at or 0,
        )
        for job in finished[:-KEEP_FINISHED] if len(finished) > KEEP_FINISHED else []:
            del self.jobs[job.id]
            with contextlib.suppress(FileNotFoundError):
                (self.directory / f"{job.id}.json").unlink()


# -- listing ---------------------------------------------------------------------------


def _entry_dict(hash_: str, size: int, shape: tuple[int, ...] | None, tier: str) -> dict[str, Any]:
    return {
        "hash": hash_,
        "size": size,
        "shape": list(shape) if shape is not None else None,
        "tier": tier,
    }


async def disk_page(
    disk: DiskTier, model: str, dtype: str, after: str | None, limit: int
) -> tuple[list[dict[str, Any]], str | None]:
    listed, cursor = await anyio.to_thread.run_sync(disk.list_namespace, model, dtype, after, limit)
    return [
        _entry_dict(e.hash, e.size, e.header.shape if e.header else None, "disk") for e in listed
    ], cursor


async def s3_page(
    s3: RemoteTier, model: str, dtype: str, after: str | None, limit: int
) -> tuple[list[dict[str, Any]], str | None]:
    """A page of the namespace's objects in S3; shapes from each object's metadata."""
    prefix = s3.namespace_prefix(model, dtype)
    start_after = f"{prefix}{after}{SUFFIX}" if after else None
    objects, marker = await s3.list_page(prefix, start_after=start_after, limit=limit)
    named = [
        (key[len(prefix) : -len(SUFFIX)], size) for key, size in objects if key.endswith(SUFFIX)
    ]
    limit_heads = asyncio.Semaphore(S3_DESCRIBE_CONCURRENCY)

    async def shape(hash_: str) -> tuple[int, ...] | None:
        async with limit_heads:
            with contextlib.suppress(ECError, ValueError):
                info = await s3.head(EntryKey(model, dtype, hash_), read_header=False)
                return info.header.shape if info is not None else None
        return None

    shapes = await asyncio.gather(*(shape(h) for h, _ in named))
    entries = [
        _entry_dict(h, size, found, "s3") for (h, size), found in zip(named, shapes, strict=True)
    ]
    # The cursor is the last hash listed; past sub-prefixes only (no entry on the page)
    # it is the marker itself, which sorts after them as a start_after.
    cursor = None
    if marker is not None:
        cursor = named[-1][0] if named else marker[len(prefix) :].removesuffix(SUFFIX)
    return entries, cursor
