"""The client. Written once, for asyncio, in ``ec_cache/_async/client.py``; the
blocking one in ``ec_cache/_sync/client.py`` is generated from it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from .._answers import entry_info, json_body
from .._backends import AsyncMapper
from .._call_limit import CallLimit
from .._claims import KeyStatus, batch_body, released, statuses, unknown
from .._client_base import ClientBase, Device, Progress, default_headers, device_of
from .._config import Limits, Retries, Timeouts
from .._cookies import DiscardingCookieJar
from .._exceptions import ConnectError, ECCacheError, IntegrityError, TransportError
from .._exists import EXISTS_BATCH, exists_batches, exists_body, present_list
from .._failures import RetryableStatus, to_ec_error
from .._put_body import encode_put
from .._receiver import Receiver, check_body_end
from .._routes import direct_routes, log_response
from .._tensors import EntryInfo, check_hashes
from .retries import retried
from .transport import AsyncResponseBody, AsyncTransport, Outgoing

if TYPE_CHECKING:
    import torch

__all__ = ["AsyncClient"]

T = TypeVar("T")
ReadInto = Callable[[memoryview], Awaitable[int]]


class AsyncClient(ClientBase):
    """Client for one ``(model, dtype)`` namespace of ec-cache.

    >>> import torch, ec_cache
    >>> with ec_cache.Client("http://127.0.0.1:8080", model="Qwen/Qwen2.5-VL-7B-Instruct",
    ...                      dtype=torch.bfloat16) as cache:   # doctest: +SKIP
    ...     cache.put("mm-hash-1", torch.randn(576, 4096, dtype=torch.bfloat16))
    ...     t = cache.get("mm-hash-1", device="cuda")     # None on a miss
    ...     cache.exists_many(["mm-hash-1", "mm-hash-2"])   # [True, False], one request
    True

    The blocking and the asyncio client have the same arguments and methods (those of
    the asyncio one are coroutines; asyncio event loops only, not trio; one client per
    loop). A blocking client can be shared by threads.

    Arguments:
        url: one base URL or several (replicas): ``http://host:8080``, or a proxy's
            prefix, never ending in ``/ec`` (the API's path, which the client adds;
            refused with ``ValueError``). Each key goes to the replica chosen by
            rendezvous hashing of ``(model, dtype, hash)``; when it refuses connections
            the next one in the key's order is used.
        model: the namespace, e.g. ``"Qwen/Qwen2.5-VL-7B-Instruct@a1b2c3"`` (slashes are
            sent as they are).
        dtype: a ``torch.dtype`` or its name; every tensor of this client has it.
        token: sent as ``Authorization: Bearer <token>``.
        timeouts: :class:`Timeouts` or seconds for every phase.
        retries: :class:`Retries` or a number of attempts.
        limits: :class:`Limits` (batch concurrency, connections, staging buffer pool).
        raise_on_unavailable: raise :class:`UnavailableError` on a 503 from
            ``get``/``head``/``exists`` instead of treating it as a miss.
        verify: check the CRC32C of every received body (``X-EC-CRC32C``).
        transport: an httpx transport to use instead of the SDK's own (which is
            http:// only; https:// URLs use httpx's default transport).
        headers: extra request headers.
        owner: who this client is when it claims keys (``claim_many``): 1-128
            printable ASCII characters; default: host, process id and a random part.
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
        owner: str | None = None,
    ) -> None:
        super().__init__(
            url,
            model=model,
            dtype=dtype,
            timeouts=timeouts,
            retries=retries,
            limits=limits,
            raise_on_unavailable=raise_on_unavailable,
            verify=verify,
            owner=owner,
        )
        if transport is None and self.own_transport:
            transport = AsyncTransport(
                max_connections=self.limits.max_connections,
                max_keepalive=self.limits.max_keepalive,
                keepalive_expiry=self.limits.keepalive_expiry,
            )
        self._http = httpx.AsyncClient(
            transport=transport,
            timeout=self._timeout(),
            headers=default_headers(token, dict(headers) if headers else None),
            follow_redirects=False,
            cookies=DiscardingCookieJar(),
        )
        self._mapper = AsyncMapper(self.limits.concurrency)
        # requests go straight to the SDK's transport (see ``_send``)
        self._transport = transport if isinstance(transport, AsyncTransport) else None
        self._routes = direct_routes(self._http, self.router.urls) if self._transport else {}
        self._timeouts = self._timeout().as_dict()

    # -- public API -----------------------------------------------------------------
    async def put(
        self,
        hash: str,
        tensor: torch.Tensor,
        *,
        progress: Progress | None = None,
        conditional: bool = True,
    ) -> bool:
        """Store ``tensor`` under ``hash``. Returns ``True`` when this call created the
        entry, ``False`` when it was already there (entries are immutable: the first
        writer wins and the stored tensor is unchanged).

        ``tensor`` must have the client's dtype; any shape, CPU or CUDA, contiguous or
        not. A contiguous CPU tensor is sent from its own memory.

        ``conditional`` (default): send ``If-None-Match: *`` and ``Expect:
        100-continue``, so that the server refuses a duplicate (412, seen here as
        ``False``) or an oversized body (413) before the body is sent. ``False`` sends
        the body at once (for servers or proxies that mishandle ``Expect``).
        """
        path = self._path(hash)
        body = encode_put(tensor, self.dtype, self.pool)
        body.progress = progress
        headers = self._put_headers(body, conditional)
        try:

            async def op(url: str) -> bool:
                response = await self._send("PUT", url, path, body, headers)
                try:
                    if response.status_code in (200, 201):
                        await response.aread()  # the connection goes back to the pool
                        return response.status_code == 201
                    if response.status_code == 412 and conditional:
                        await response.aread()
                        return False  # already present
                    raise await self._error(response, url)
                finally:
                    await response.aclose()

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
        timeout: float | None = None,
        stop: Callable[[], bool] | None = None,
        min_rate: float | None = None,
    ) -> torch.Tensor | None:
        """The tensor stored under ``hash``, or ``None`` on a miss (404, or 503 unless
        ``raise_on_unavailable``).

        ``device``: where the result goes (default: CPU, or ``out``'s device).
        ``out``: an existing tensor of the entry's dtype and shape to fill (returned).
        ``timeout``: seconds for the whole call, every try and body byte included (a
        server that trickles its answer cannot hold it longer); ``stop``: asked every
        50 ms while waiting, ends the call once it returns ``True``; ``min_rate``:
        bytes per second the body must average, from one second after its head came.
        Each ends the call with :class:`TransportError`. The result owns its memory.
        Raises :class:`IntegrityError` when the body does not match its checksum or
        headers.
        """
        path = self._path(hash)
        dev = device_of(device)
        limit = CallLimit.of(timeout, stop, min_rate)

        async def op(url: str) -> torch.Tensor | None:
            response = await self._send("GET", url, path, limit=limit)
            try:
                if response.status_code == 200:
                    return await self._receive(response, url, dev, out, progress)
                await self._miss(response, url)
                return None
            finally:
                await response.aclose()

        return await self._call(self._order(hash), op, limit=limit)

    async def head(
        self,
        hash: str,
        *,
        timeout: float | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> EntryInfo | None:
        """What the server knows about ``hash`` (dtype, shape, size, checksum, tier), or
        ``None`` on a miss. Never transfers the body. ``timeout`` and ``stop``: as
        for :meth:`get`."""
        path = self._path(hash)
        limit = CallLimit.of(timeout, stop)

        async def op(url: str) -> EntryInfo | None:
            response = await self._send("HEAD", url, path, limit=limit)
            await response.aread()  # the empty body: the connection can be reused
            if response.status_code == 200:
                return entry_info(hash, response, url)
            await self._miss(response, url)
            return None

        return await self._call(self._order(hash), op, limit=limit)

    async def exists(self, hash: str) -> bool:
        """Whether ``hash`` is stored (a ``HEAD``; a 503 counts as absent)."""
        return await self.head(hash) is not None

    async def exists_many(self, hashes: Iterable[str]) -> list[bool]:
        """Existence of many hashes, in order: one ``POST .../_exists`` per replica and
        per 1000 hashes, the replicas asked at once."""
        return await self._batched(check_hashes(hashes), self._exists_batch)

    # Claims: one engine computes a new entry, the others wait (docs/http-api.md, Claims).
    # Each key's claim lives on the replica its rendezvous hash picks, like its entry.

    async def status_many(self, hashes: Iterable[str]) -> list[KeyStatus]:
        """Each hash's :class:`KeyStatus`, in order: ``present``, ``absent``, or
        ``computing`` (another client claimed it); batched as ``exists_many``."""

        async def ask(order: list[str], batch: list[str]) -> list[KeyStatus]:
            document = {"hashes": batch, "claims": True}
            return await self._batch_op(order, "_exists", document, batch, statuses, unknown)

        return await self._batched(check_hashes(hashes), ask)

    async def claim_many(self, hashes: Iterable[str], *, lease: float) -> list[KeyStatus]:
        """Claim each absent, unclaimed hash for this client (``owner``) for ``lease``
        seconds, the time it expects to compute and ``put`` the entry (the server caps
        it). Where ``granted`` is true, compute and ``put`` it (or ``release_many``);
        elsewhere the status says it is ``present`` or ``computing`` by another client.
        Claiming again renews the lease. A 503 (unless ``raise_on_unavailable``) answers
        ``absent``, not granted: compute it."""
        lease_ms = max(1, round(lease * 1000))

        async def ask(order: list[str], batch: list[str]) -> list[KeyStatus]:
            document = {"hashes": batch, "owner": self.owner, "lease_ms": lease_ms}
            return await self._batch_op(order, "_claim", document, batch, statuses, unknown)

        return await self._batched(check_hashes(hashes), ask)

    async def release_many(self, hashes: Iterable[str]) -> list[bool]:
        """Give up this client's claims (it will not compute these after all); whoever
        waits for them wakes. True where a claim of this client ended."""

        async def ask(order: list[str], batch: list[str]) -> list[bool]:
            document = {"hashes": batch, "owner": self.owner}
            return await self._batch_op(
                order, "_release", document, batch, released, lambda b: [False] * len(b)
            )

        return await self._batched(check_hashes(hashes), ask)

    async def wait_many(self, hashes: Iterable[str], *, timeout: float) -> list[KeyStatus]:
        """Wait, at most ``timeout`` seconds, until no hash is ``computing`` (each was
        stored, or its claim was released or expired); then each hash's status. One
        held request per replica, no polling. A 503 (too many waiters there, unless
        ``raise_on_unavailable``) answers ``absent``: compute it."""
        timeout_ms = max(0, round(timeout * 1000))
        held = self._timeout()
        if held.read is not None:  # the answer comes when the wait ends
            held = httpx.Timeout(
                connect=held.connect, read=held.read + timeout, write=held.write, pool=held.pool
            )

        async def ask(order: list[str], batch: list[str]) -> list[KeyStatus]:
            document = {"hashes": batch, "timeout_ms": timeout_ms}
            return await self._batch_op(
                order, "_wait", document, batch, statuses, unknown, timeout=held
            )

        return await self._batched(check_hashes(hashes), ask)

    async def get_many(
        self, hashes: Iterable[str], *, device: Device = None
    ) -> list[torch.Tensor | None]:
        """``get`` of every hash, ``Limits.concurrency`` at a time; results in order."""

        async def one(h: str) -> torch.Tensor | None:
            return await self.get(h, device=device)

        return await self._mapper.map(one, list(hashes))

    async def put_many(
        self, items: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> list[bool]:
        """``put`` of every ``(hash, tensor)``, ``Limits.concurrency`` at a time;
        results (created or not) in order."""
        pairs = list(items.items() if isinstance(items, Mapping) else items)

        async def one(pair: tuple[str, torch.Tensor]) -> bool:
            return await self.put(pair[0], pair[1])

        return await self._mapper.map(one, pairs)

    async def delete(self, hash: str) -> None:
        """Remove ``hash`` from every replica (each one's disk, and S3 where it has an S3
        tier). Replicas that refuse connections are skipped; raises when none could be
        reached."""
        path = self._path(hash)

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
        """``GET /stats`` of every replica: ``{url: stats}``; an unreachable or failing
        replica maps to ``{"error": "..."}``."""
        result: dict[str, dict[str, Any]] = {}

        async def op(url: str) -> dict[str, Any]:
            response = await self._http.get(url + "/stats")
            if response.status_code != 200:
                raise await self._error(response, url)
            data = json_body(response.content, url)
            return data if isinstance(data, dict) else {"stats": data}

        for url in self.router.urls:
            try:
                result[url] = await self._call([url], op)
            except ECCacheError as exc:
                result[url] = {"error": str(exc)}
        return result

    async def aclose(self) -> None:
        """Close connections (and worker threads); idempotent."""
        await self._mapper.aclose()
        await self._http.aclose()
        self.pool.clear()
        self.results.clear()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- internals ------------------------------------------------------------------
    async def _send(
        self,
        method: str,
        url: str,
        path: str,
        body: httpx.AsyncByteStream | None = None,
        headers: dict[str, str] | None = None,
        timeout: httpx.Timeout | None = None,
        *,
        limit: CallLimit | None = None,
    ) -> httpx.Response:
        """``method url+path`` with the client's headers and timeouts, streamed;
        ``body`` and its ``headers`` (its Content-Length among them), if given, are
        sent with it; ``timeout`` replaces the client's timeouts for this request.

        With the SDK's transport the request goes to it directly: building an
        ``httpx.Request`` (URL parsing, header merging) and ``httpx.Client.send``
        (auth and redirect machinery, none of which the SDK uses) cost more client CPU
        than the rest of a GET's Python together. Same headers, timeouts, pool and
        exceptions; no ``response.request``. ``limit`` bounds the whole exchange
        (through a stock httpx transport, each of its phases)."""
        route = self._routes.get(url)
        if route is None or self._transport is None or self._http.is_closed:
            request = self._http.build_request(
                method,
                url + path,
                headers=headers,
                timeout=timeout
                or (httpx.USE_CLIENT_DEFAULT if limit is None else self._phase_timeout(limit)),
            )
            if body is not None:
                request.stream = body
            return await self._http.send(request, stream=True)
        fields = route.headers
        if headers:
            fields = [*fields, *((k.encode(), v.encode()) for k, v in headers.items())]
        out = Outgoing(method.encode(), route.target(path), fields, body, None, limit)
        timeouts = self._timeouts if timeout is None else timeout.as_dict()
        response = await self._transport.send(route.key, out, timeouts)
        log_response(method, url + path, response)
        return response

    async def _batched(
        self, hashes: list[str], ask: Callable[[list[str], list[str]], Awaitable[list[T]]]
    ) -> list[T]:
        """``ask(order, batch)`` for batches of at most 1000 hashes, each sent to the
        replica its keys' rendezvous order picks (the next one when it refuses
        connections), the replicas asked at once; the answers in the order of
        ``hashes``."""
        if len(self.router.urls) == 1:  # no replica order to follow: batches in order
            url, size = self.router.urls[0], EXISTS_BATCH
            slices = [hashes[start : start + size] for start in range(0, len(hashes), size)]

            async def ask_one(batch: list[str]) -> list[T]:
                return await ask([url], batch)

            found = await self._mapper.map(ask_one, slices)
            return [value for answer in found for value in answer]
        orders = self.router.orders(self.model, self.dtype, hashes)
        answered: dict[int, T] = {}
        pending, dead = list(range(len(hashes))), set[str]()

        async def ask_replica(item: tuple[str, list[int]]) -> list[T] | ConnectError:
            url, batch = item
            try:
                return await ask([url], [hashes[i] for i in batch])
            except ConnectError as exc:
                return exc

        while pending:
            batches, pending = exists_batches(orders, pending, dead), []
            answers = await self._mapper.map(ask_replica, batches)
            for (url, batch), answer in zip(batches, answers, strict=True):
                if isinstance(answer, ConnectError):  # each key moves on to its next replica
                    dead.add(url)
                    pending += batch
                    continue
                answered.update(zip(batch, answer, strict=True))
        return [answered[i] for i in range(len(hashes))]

    async def _batch_op(
        self,
        order: list[str],
        name: str,
        document: dict[str, Any],
        batch: list[str],
        read: Callable[[Any, int, str], list[T]],
        unavailable: Callable[[list[str]], list[T]],
        *,
        timeout: httpx.Timeout | None = None,
    ) -> list[T]:
        """``POST .../{name}`` with a JSON ``document`` about ``batch``: ``read`` of the
        answer, or ``unavailable(batch)`` for a 503 that counts as a miss."""
        path = self._batch_path(name)
        request_body = batch_body(document)

        async def op(url: str) -> list[T]:
            response = await self._send("POST", url, path, *request_body, timeout=timeout)
            try:
                content = await response.aread()
            finally:
                await response.aclose()
            if response.status_code == 200:
                return read(json_body(content, url), len(batch), url)
            error = self._error_from(response, content, url)
            if self._is_miss(error):
                return unavailable(batch)
            raise error

        return await self._call(order, op)

    async def _exists_batch(self, order: list[str], batch: list[str]) -> list[bool]:
        path = self._exists_path()
        request_body = exists_body(batch)

        async def op(url: str) -> list[bool]:
            response = await self._send("POST", url, path, *request_body)
            try:
                content = await response.aread()
            finally:
                await response.aclose()
            if response.status_code == 200:
                return present_list(json_body(content, url), len(batch), url)
            await self._miss(response, url)
            return [False] * len(batch)

        return await self._call(order, op)

    async def _call(
        self,
        order: list[str],
        op: Callable[[str], Awaitable[T]],
        *,
        resend: bool = True,
        limit: CallLimit | None = None,
    ) -> T:
        """Run ``op(url)`` over the replica order with failover, retried as
        ``Retries`` says (``resend=False``: only a refused connection is tried again,
        on the next replica) within ``limit``."""
        attempts = self.retries.attempts if resend else 1
        tried = order[0]

        async def over_replicas() -> T:
            nonlocal tried
            refused: httpx.TransportError | None = None
            for url in order:
                tried = url
                try:
                    return await op(url)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    refused = exc  # nothing was sent: the next replica, at once
            assert refused is not None  # an order lists at least one replica
            raise refused

        try:
            return await retried(
                over_replicas,
                lambda error, attempt: self._retry_delay(error, attempt, attempts, limit),
            )
        except (httpx.TransportError, RetryableStatus) as exc:
            raise to_ec_error(exc, tried) from None

    async def _error(self, response: httpx.Response, url: str) -> BaseException:
        try:
            body = await response.aread()
        except httpx.HTTPError:
            body = b""
        return self._error_from(response, body, url)

    async def _miss(self, response: httpx.Response, url: str) -> None:
        """``None`` for 404 (and 503 unless configured to raise); raises otherwise."""
        if response.status_code == 404:
            return None
        error = await self._error(response, url)
        if self._is_miss(error):
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
        rx = self._receiver(response, url, device, out)
        body = response.extensions.get("ec_body")
        readinto: ReadInto = (
            body.readinto
            if isinstance(body, AsyncResponseBody)
            else AsyncIterReader(response.aiter_raw()).readinto
        )
        try:
            prefix = await _read_exact(readinto, 8, rx)
            header = await _read_exact(readinto, rx.header_length(prefix), rx)
            target = rx.plan(header)
            await _fill(readinto, target, rx, progress, rx.landed)
            check_body_end(await readinto(memoryview(bytearray(1))))
            return rx.finish()
        finally:
            rx.release()


class AsyncIterReader:
    """``readinto`` over a plain httpx byte iterator (stock transports, https)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._left = memoryview(b"")

    async def readinto(self, mv: memoryview) -> int:
        while not self._left:
            chunk = await anext(self._chunks, None)
            if chunk is None:
                return 0
            self._left = memoryview(chunk)
        n = min(len(mv), len(self._left))
        mv[:n] = self._left[:n]
        self._left = self._left[n:]
        return n


async def _read_exact(readinto: ReadInto, n: int, rx: Receiver) -> bytes:
    buf = bytearray(n)
    await _fill(readinto, memoryview(buf), rx, None)
    return bytes(buf)


async def _fill(
    readinto: ReadInto,
    target: memoryview,
    rx: Receiver,
    progress: Progress | None,
    landed: Callable[[int], None] | None = None,
) -> None:
    filled, size = 0, len(target)
    crc = rx.crc if rx.verify else None
    while filled < size:
        n = await readinto(target[filled:])
        if n == 0:
            raise IntegrityError(f"{rx.url}: body ended {size - filled} bytes early")
        if crc is not None:
            crc.update(target[filled : filled + n])
        filled += n
        rx.received += n
        if landed is not None:
            landed(filled)
        if progress is not None:
            progress(rx.received, rx.total or 0)
