"""The blocking client."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

import httpx
import torch

from . import _core
from ._buffers import BufferPool
from ._config import Limits, Retries, Timeouts
from ._core import IterReader, Progress, Receiver, RetryableStatus
from ._exceptions import (
    ConnectError,
    ECCacheError,
    IntegrityError,
    TransportError,
    UnavailableError,
)
from ._routing import Router
from ._tensors import EntryInfo, check_hash, check_model, parse_dtype
from ._transport import SyncBody, SyncTransport

__all__ = ["Client"]

T = TypeVar("T")
Device = torch.device | str | int | None


class Client:
    """Blocking client for one ``(model, dtype)`` namespace of ec-cache.

    >>> import torch, ec_cache
    >>> with ec_cache.Client("http://127.0.0.1:8080", model="Qwen/Qwen2.5-VL-7B-Instruct",
    ...                      dtype=torch.bfloat16) as cache:   # doctest: +SKIP
    ...     cache.put("mm-hash-1", torch.randn(576, 4096, dtype=torch.bfloat16))
    ...     t = cache.get("mm-hash-1", device="cuda")     # None on a miss
    ...     cache.exists_many(["mm-hash-1", "mm-hash-2"])   # [True, False], one request
    True

    Arguments:
        url: one base URL or several (replicas). Each key goes to the replica chosen by
            rendezvous hashing of ``(model, dtype, hash)``; when it refuses connections
            the next one in the key's order is used.
        model: the namespace, e.g. ``"Qwen/Qwen2.5-VL-7B-Instruct@a1b2c3"`` (slashes are
            sent as they are).
        dtype: a ``torch.dtype`` or its name; every tensor of this client has it.
        token: sent as ``Authorization: Bearer <token>``.
        timeouts: :class:`Timeouts` or seconds for every phase.
        retries: :class:`Retries` or a number of attempts.
        limits: :class:`Limits` (batch concurrency, keep-alive, staging buffer pool).
        raise_on_unavailable: raise :class:`UnavailableError` on a 503 from
            ``get``/``head``/``exists`` instead of treating it as a miss.
        verify: check the CRC32C of every received body (``X-EC-CRC32C``).
        transport: an ``httpx.BaseTransport`` to use instead of the SDK's own
            (which is http:// only; https:// URLs use httpx's default transport).
        headers: extra request headers.

    Thread-safe: one client can be shared by threads.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        model: str,
        dtype: torch.dtype | str,
        token: str | None = None,
        timeouts: Timeouts | float | None = None,
        retries: Retries | int | None = None,
        limits: Limits | None = None,
        raise_on_unavailable: bool = False,
        verify: bool = True,
        transport: httpx.BaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.model = check_model(model)
        self.dtype = parse_dtype(dtype)
        self.router = Router([url] if isinstance(url, str) else url)
        self.timeouts = Timeouts() if timeouts is None else Timeouts.of(timeouts)
        self.retries = Retries() if retries is None else Retries.of(retries)
        self.limits = limits or Limits()
        self.raise_on_unavailable = raise_on_unavailable
        self.verify = verify
        self.pool = BufferPool(self.limits.buffer_pool_bytes)
        if transport is None and all(u.startswith("http://") for u in self.router.urls):
            transport = SyncTransport(
                max_keepalive=self.limits.max_keepalive,
                keepalive_expiry=self.limits.keepalive_expiry,
            )
        self._http = httpx.Client(
            transport=transport,
            timeout=self.timeouts.to_httpx(),
            headers=_core.default_headers(token, dict(headers) if headers else None),
            follow_redirects=False,
        )
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    # -- public API -----------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        from ._tensors import DTYPES

        return DTYPES[self.dtype][0]

    @property
    def urls(self) -> list[str]:
        return list(self.router.urls)

    def put(self, hash: str, tensor: torch.Tensor, *, progress: Progress | None = None) -> bool:
        """Store ``tensor`` under ``hash``. Returns ``True`` when this call created the
        entry, ``False`` when it was already there (entries are immutable: the first
        writer wins and the stored tensor is unchanged).

        ``tensor`` must have the client's dtype; any shape, CPU or CUDA, contiguous or
        not. A contiguous CPU tensor is sent from its own memory.
        """
        path = self._path(check_hash(hash))
        body = _core.encode_put(tensor, self.dtype, self.pool)
        body.progress = progress
        try:

            def op(url: str) -> bool:
                request = self._http.build_request("PUT", url + path, headers=body.headers())
                request.stream = body
                response = self._http.send(request)
                if response.status_code in (200, 201):
                    return response.status_code == 201
                raise self._error(response, url)

            return self._call(self._order(hash), op, resend=self.retries.retry_put)
        finally:
            body.release()

    def get(
        self,
        hash: str,
        *,
        device: Device = None,
        out: torch.Tensor | None = None,
        progress: Progress | None = None,
    ) -> torch.Tensor | None:
        """The tensor stored under ``hash``, or ``None`` on a miss (404, or 503 unless
        ``raise_on_unavailable``).

        ``device``: where the result goes (default: CPU, or ``out``'s device).
        ``out``: an existing tensor of the entry's dtype and shape to fill (returned).
        The result owns its memory. Raises :class:`IntegrityError` when the body does not
        match its checksum or headers.
        """
        path = self._path(check_hash(hash))
        device = _device(device)

        def op(url: str) -> torch.Tensor | None:
            response = self._http.send(self._http.build_request("GET", url + path), stream=True)
            try:
                if response.status_code == 200:
                    return self._receive(response, url, device, out, progress)
                self._miss(response, url)
                return None
            finally:
                response.close()

        return self._call(self._order(hash), op)

    def head(self, hash: str) -> EntryInfo | None:
        """What the server knows about ``hash`` (dtype, shape, size, checksum, tier), or
        ``None`` on a miss. Never transfers the body."""
        path = self._path(check_hash(hash))

        def op(url: str) -> EntryInfo | None:
            response = self._http.send(self._http.build_request("HEAD", url + path))
            if response.status_code == 200:
                return _core.entry_info(hash, response, url)
            self._miss(response, url)
            return None

        return self._call(self._order(hash), op)

    def exists(self, hash: str) -> bool:
        """Whether ``hash`` is stored (a ``HEAD``; a 503 counts as absent)."""
        return self.head(hash) is not None

    def exists_many(self, hashes: Iterable[str]) -> list[bool]:
        """Existence of many hashes, in order: one ``POST .../_exists`` per replica and
        per 1000 hashes."""
        hashes = [check_hash(h) for h in hashes]
        orders = [self._order(h) for h in hashes]
        present = [False] * len(hashes)
        pending, dead = list(range(len(hashes))), set[str]()
        while pending:
            batches, pending = _core.exists_batches(orders, pending, dead), []
            for url, batch in batches:
                try:
                    answer = self._exists_batch([url], [hashes[i] for i in batch])
                except ConnectError:  # each key moves on to its own next replica
                    dead.add(url)
                    pending += batch
                    continue
                for i, value in zip(batch, answer, strict=True):
                    present[i] = value
        return present

    def get_many(
        self, hashes: Iterable[str], *, device: Device = None
    ) -> list[torch.Tensor | None]:
        """``get`` of every hash, ``Limits.concurrency`` at a time; results in order."""
        hashes = list(hashes)
        if len(hashes) <= 1:
            return [self.get(h, device=device) for h in hashes]
        return list(self._pool_executor().map(lambda h: self.get(h, device=device), hashes))

    def put_many(
        self, items: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> list[bool]:
        """``put`` of every ``(hash, tensor)``, ``Limits.concurrency`` at a time;
        results (created or not) in order."""
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        if len(pairs) <= 1:
            return [self.put(h, t) for h, t in pairs]
        return list(self._pool_executor().map(lambda p: self.put(p[0], p[1]), pairs))

    def delete(self, hash: str) -> None:
        """Remove ``hash`` from every replica (each one's disk, and S3). Replicas that
        refuse connections are skipped; raises when none could be reached."""
        path = self._path(check_hash(hash))

        def op(url: str) -> None:
            response = self._http.send(self._http.build_request("DELETE", url + path))
            if response.status_code not in (200, 204, 404):
                raise self._error(response, url)

        reached = False
        last: ECCacheError | None = None
        for url in self._order(hash):
            try:
                self._call([url], op)
                reached = True
            except TransportError as exc:
                last = exc
        if not reached and last is not None:
            raise last

    def stats(self) -> dict[str, dict[str, Any]]:
        """``GET /stats`` of every replica: ``{url: stats}``; an unreachable or failing
        replica maps to ``{"error": "..."}``."""
        result: dict[str, dict[str, Any]] = {}
        for url in self.router.urls:

            def op(url: str) -> dict[str, Any]:
                response = self._http.get(url + "/stats")
                if response.status_code != 200:
                    raise self._error(response, url)
                data = _core.json_body(response.content, url)
                return data if isinstance(data, dict) else {"stats": data}

            try:
                result[url] = self._call([url], op)
            except ECCacheError as exc:
                result[url] = {"error": str(exc)}
        return result

    def close(self) -> None:
        """Close connections and worker threads; idempotent."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._http.close()
        self.pool.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.router.urls!r}, model={self.model!r}, dtype={self.dtype!r})"

    # -- internals ------------------------------------------------------------------
    def _path(self, hash: str) -> str:
        return f"/ec/{self.model}/{self.dtype}/{hash}"

    def _order(self, hash: str) -> list[str]:
        return self.router.order(self.model, self.dtype, hash)

    def _exists_batch(self, order: list[str], batch: list[str]) -> list[bool]:
        path = f"/ec/{self.model}/{self.dtype}/_exists"

        def op(url: str) -> list[bool]:
            response = self._http.post(url + path, json={"hashes": batch})
            if response.status_code == 200:
                present = _core.json_body(response.content, url).get("present")
                if not isinstance(present, list) or len(present) != len(batch):
                    raise TransportError(f"{url}: malformed _exists answer", url=url)
                return [bool(v) for v in present]
            self._miss(response, url)
            return [False] * len(batch)

        return self._call(order, op)

    def _pool_executor(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self.limits.concurrency, thread_name_prefix="ec-cache"
                )
            return self._executor

    def _call(self, order: list[str], op: Callable[[str], T], *, resend: bool = True) -> T:
        """Run ``op(url)`` over the replica order with failover and retries."""
        attempts = self.retries.attempts if resend else 1
        last: BaseException | None = None
        last_url = order[0]
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.retries.delay(attempt))
            for url in order:
                last_url = url
                try:
                    return op(url)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    last = exc  # nothing was sent: the next replica, at once
                    continue
                except (httpx.TransportError, RetryableStatus) as exc:
                    last = exc
                    break
        raise _core.to_ec_error(last, last_url)

    def _error(self, response: httpx.Response, url: str) -> BaseException:
        try:
            body = response.read()
        except httpx.HTTPError:
            body = b""
        error = _core.error_for(response, body, url)
        if response.status_code in self.retries.statuses:
            return RetryableStatus(error)
        return error

    def _miss(self, response: httpx.Response, url: str) -> None:
        """``None`` for 404 (and 503 unless configured to raise); raises otherwise."""
        if response.status_code == 404:
            return None
        error = self._error(response, url)
        if isinstance(error, UnavailableError) and not self.raise_on_unavailable:
            return None
        raise error

    def _receive(
        self,
        response: httpx.Response,
        url: str,
        device: torch.device | None,
        out: torch.Tensor | None,
        progress: Progress | None,
    ) -> torch.Tensor:
        rx = Receiver(
            dtype=self.dtype,
            resp=response,
            url=url,
            device=device,
            out=out,
            pool=self.pool,
            verify=self.verify,
        )
        body = response.extensions.get("ec_body")
        readinto: Callable[[memoryview], int] = (
            body.readinto
            if isinstance(body, SyncBody)
            else IterReader(response.iter_raw()).readinto
        )
        try:
            prefix = _read_exact(readinto, 8, rx)
            header = _read_exact(readinto, rx.header_length(prefix), rx)
            target = rx.plan(header)
            _fill(readinto, target, rx, progress)
            _core.check_body_end(readinto(memoryview(bytearray(1))))
            return rx.finish()
        finally:
            rx.release()


def _device(device: Device) -> torch.device | None:
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def _read_exact(readinto: Callable[[memoryview], int], n: int, rx: Receiver) -> bytes:
    buf = bytearray(n)
    _fill(readinto, memoryview(buf), rx, None)
    return bytes(buf)


def _fill(
    readinto: Callable[[memoryview], int],
    target: memoryview,
    rx: Receiver,
    progress: Progress | None,
) -> None:
    filled, size = 0, len(target)
    crc = rx.crc
    while filled < size:
        n = readinto(target[filled:])
        if n == 0:
            raise IntegrityError(f"{rx.url}: body ended {size - filled} bytes early")
        crc.update(target[filled : filled + n])
        filled += n
        rx.received += n
        if progress is not None:
            progress(rx.received, rx.total or 0)
