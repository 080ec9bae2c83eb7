"""The asyncio client: :class:`Client`'s methods as coroutines."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx
import torch

from . import _core
from ._async_transport import AsyncBody, AsyncTransport
from ._buffers import BufferPool
from ._client import Device, _device
from ._config import Limits, Retries, Timeouts
from ._core import AsyncIterReader, Progress, Receiver, RetryableStatus
from ._exceptions import (
    ConnectError,
    ECCacheError,
    IntegrityError,
    TransportError,
    UnavailableError,
)
from ._routing import Router
from ._tensors import DTYPES, EntryInfo, check_hash, check_model, parse_dtype

__all__ = ["AsyncClient"]

T = TypeVar("T")
_ReadInto = Callable[[memoryview], Awaitable[int]]


class AsyncClient:
    """asyncio client; same arguments and methods as :class:`Client`, awaitable.

    >>> async def main() -> None:                                   # doctest: +SKIP
    ...     async with ec_cache.AsyncClient("http://cache:8080", model="m",
    ...                                     dtype=torch.bfloat16) as cache:
    ...         await cache.put("h1", torch.ones(4, 8, dtype=torch.bfloat16))
    ...         tensors = await cache.get_many(["h1", "h2"])          # [Tensor, None]

    Bodies are received with ``loop.sock_recv_into`` straight into the destination
    memory (asyncio event loops only, not trio). Use one client per event loop.
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
        transport: httpx.AsyncBaseTransport | None = None,
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
            transport = AsyncTransport(
                max_keepalive=self.limits.max_keepalive,
                keepalive_expiry=self.limits.keepalive_expiry,
            )
        self._http = httpx.AsyncClient(
            transport=transport,
            timeout=self.timeouts.to_httpx(),
            headers=_core.default_headers(token, dict(headers) if headers else None),
            follow_redirects=False,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def urls(self) -> list[str]:
        return list(self.router.urls)

    async def put(
        self, hash: str, tensor: torch.Tensor, *, progress: Progress | None = None
    ) -> bool:
        """See :meth:`Client.put`."""
        path = self._path(check_hash(hash))
        body = _core.encode_put(tensor, self.dtype, self.pool)
        body.progress = progress
        try:

            async def op(url: str) -> bool:
                request = self._http.build_request("PUT", url + path, headers=body.headers())
                request.stream = body
                response = await self._http.send(request)
                if response.status_code in (200, 201):
                    return response.status_code == 201
                raise await self._error(response, url)

            return await self._call(self._order(hash), op, resend=self.retries.retry_put)
        finally:
            body.release()

    async def get(
        self,
        hash: str,
        *,
        device: Device = None,
        out: torch.Tensor | None = None,
        progress: Progress | None = None,
    ) -> torch.Tensor | None:
        """See :meth:`Client.get`."""
        path = self._path(check_hash(hash))
        dev = _device(device)

        async def op(url: str) -> torch.Tensor | None:
            request = self._http.build_request("GET", url + path)
            response = await self._http.send(request, stream=True)
            try:
                if response.status_code == 200:
                    return await self._receive(response, url, dev, out, progress)
                await self._miss(response, url)
                return None
            finally:
                await response.aclose()

        return await self._call(self._order(hash), op)

    async def head(self, hash: str) -> EntryInfo | None:
        """See :meth:`Client.head`."""
        path = self._path(check_hash(hash))

        async def op(url: str) -> EntryInfo | None:
            response = await self._http.send(self._http.build_request("HEAD", url + path))
            if response.status_code == 200:
                return _core.entry_info(hash, response, url)
            await self._miss(response, url)
            return None

        return await self._call(self._order(hash), op)

    async def exists(self, hash: str) -> bool:
        """See :meth:`Client.exists`."""
        return await self.head(hash) is not None

    async def exists_many(self, hashes: Iterable[str]) -> list[bool]:
        """See :meth:`Client.exists_many`; replicas are asked concurrently."""
        hashes = [check_hash(h) for h in hashes]
        orders = [self._order(h) for h in hashes]
        present = [False] * len(hashes)
        pending, dead = list(range(len(hashes))), set[str]()
        while pending:
            batches, pending = _core.exists_batches(orders, pending, dead), []
            answers = await asyncio.gather(
                *(self._exists_batch([url], [hashes[i] for i in batch]) for url, batch in batches),
                return_exceptions=True,
            )
            for (url, batch), answer in zip(batches, answers, strict=True):
                if isinstance(answer, ConnectError):  # each key moves on to its next replica
                    dead.add(url)
                    pending += batch
                elif isinstance(answer, BaseException):
                    raise answer
                else:
                    for i, value in zip(batch, answer, strict=True):
                        present[i] = value
        return present

    async def get_many(
        self, hashes: Iterable[str], *, device: Device = None
    ) -> list[torch.Tensor | None]:
        """See :meth:`Client.get_many`."""
        limit = asyncio.Semaphore(self.limits.concurrency)

        async def one(h: str) -> torch.Tensor | None:
            async with limit:
                return await self.get(h, device=device)

        return list(await asyncio.gather(*(one(h) for h in hashes)))

    async def put_many(
        self, items: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> list[bool]:
        """See :meth:`Client.put_many`."""
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        limit = asyncio.Semaphore(self.limits.concurrency)

        async def one(h: str, t: torch.Tensor) -> bool:
            async with limit:
                return await self.put(h, t)

        return list(await asyncio.gather(*(one(h, t) for h, t in pairs)))

    async def delete(self, hash: str) -> None:
        """See :meth:`Client.delete`."""
        path = self._path(check_hash(hash))

        async def op(url: str) -> None:
            response = await self._http.send(self._http.build_request("DELETE", url + path))
            if response.status_code not in (200, 204, 404):
                raise await self._error(response, url)

        reached = False
        last: ECCacheError | None = None
        for url in self._order(hash):
            try:
                await self._call([url], op)
                reached = True
            except TransportError as exc:
                last = exc
        if not reached and last is not None:
            raise last

    async def stats(self) -> dict[str, dict[str, Any]]:
        """See :meth:`Client.stats`."""
        result: dict[str, dict[str, Any]] = {}

        async def op(url: str) -> dict[str, Any]:
            response = await self._http.get(url + "/stats")
            if response.status_code != 200:
                raise await self._error(response, url)
            data = _core.json_body(response.content, url)
            return data if isinstance(data, dict) else {"stats": data}

        for url in self.router.urls:
            try:
                result[url] = await self._call([url], op)
            except ECCacheError as exc:
                result[url] = {"error": str(exc)}
        return result

    async def aclose(self) -> None:
        """Close connections; idempotent."""
        await self._http.aclose()
        self.pool.clear()

    close = aclose

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncClient({self.router.urls!r}, model={self.model!r}, dtype={self.dtype!r})"

    # -- internals ------------------------------------------------------------------
    def _path(self, hash: str) -> str:
        return f"/ec/{self.model}/{self.dtype}/{hash}"

    def _order(self, hash: str) -> list[str]:
        return self.router.order(self.model, self.dtype, hash)

    async def _exists_batch(self, order: list[str], batch: list[str]) -> list[bool]:
        path = f"/ec/{self.model}/{self.dtype}/_exists"

        async def op(url: str) -> list[bool]:
            response = await self._http.post(url + path, json={"hashes": batch})
            if response.status_code == 200:
                present = _core.json_body(response.content, url).get("present")
                if not isinstance(present, list) or len(present) != len(batch):
                    raise TransportError(f"{url}: malformed _exists answer", url=url)
                return [bool(v) for v in present]
            await self._miss(response, url)
            return [False] * len(batch)

        return await self._call(order, op)

    async def _call(
        self, order: list[str], op: Callable[[str], Awaitable[T]], *, resend: bool = True
    ) -> T:
        attempts = self.retries.attempts if resend else 1
        last: BaseException | None = None
        last_url = order[0]
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.retries.delay(attempt))
            for url in order:
                last_url = url
                try:
                    return await op(url)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    last = exc
                    continue
                except (httpx.TransportError, RetryableStatus) as exc:
                    last = exc
                    break
        raise _core.to_ec_error(last, last_url)

    async def _error(self, response: httpx.Response, url: str) -> BaseException:
        try:
            body = await response.aread()
        except httpx.HTTPError:
            body = b""
        error = _core.error_for(response, body, url)
        if response.status_code in self.retries.statuses:
            return RetryableStatus(error)
        return error

    async def _miss(self, response: httpx.Response, url: str) -> None:
        if response.status_code == 404:
            return None
        error = await self._error(response, url)
        if isinstance(error, UnavailableError) and not self.raise_on_unavailable:
            return None
        raise error

    async def _receive(
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
        readinto: _ReadInto = (
            body.readinto
            if isinstance(body, AsyncBody)
            else AsyncIterReader(response.aiter_raw()).readinto
        )
        try:
            prefix = await _read_exact(readinto, 8, rx)
            header = await _read_exact(readinto, rx.header_length(prefix), rx)
            target = rx.plan(header)
            await _fill(readinto, target, rx, progress)
            _core.check_body_end(await readinto(memoryview(bytearray(1))))
            return rx.finish()
        finally:
            rx.release()


async def _read_exact(readinto: _ReadInto, n: int, rx: Receiver) -> bytes:
    buf = bytearray(n)
    await _fill(readinto, memoryview(buf), rx, None)
    return bytes(buf)


async def _fill(
    readinto: _ReadInto, target: memoryview, rx: Receiver, progress: Progress | None
) -> None:
    filled, size = 0, len(target)
    crc = rx.crc
    while filled < size:
        n = await readinto(target[filled:])
        if n == 0:
            raise IntegrityError(f"{rx.url}: body ended {size - filled} bytes early")
        crc.update(target[filled : filled + n])
        filled += n
        rx.received += n
        if progress is not None:
            progress(rx.received, rx.total or 0)
