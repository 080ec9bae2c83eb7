"""What the sync and async clients share (no I/O here): configuration, paths, request
bodies, response checks and the sans-I/O receiving of a tensor body.

The I/O is written once, as asyncio code, in :mod:`ec_cache._async`;
:mod:`ec_cache._sync` is generated from it (``scripts/unasync.py``).
"""

from __future__ import annotations

import http.cookiejar
import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any

import httpx
import torch

from . import _cuda
from ._buffers import BufferPool, PooledBuffer
from ._config import Limits, Retries, Timeouts
from ._crc import Crc32c
from ._exceptions import (
    ConnectError,
    ECCacheError,
    IntegrityError,
    InvalidTensorError,
    ServerError,
    TransportError,
    TransportTimeout,
    UnavailableError,
)
from ._routing import Router
from ._tensors import (
    DTYPES,
    EntryInfo,
    TensorMeta,
    build_header,
    check_hash,
    check_model,
    check_tensor,
    parse_dtype,
    parse_header,
    parse_header_length,
    parse_shape,
    tensor_memoryview,
)

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called as a body goes out or comes in."""

EXISTS_BATCH = 1000

Device = torch.device | str | int | None
"""Where a result goes: a ``torch.device``, its name, or a CUDA ordinal."""


def device_of(device: Device) -> torch.device | None:
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def split_chunks(data: memoryview | bytes, size: int = 8 << 20) -> list[memoryview | bytes]:
    """``data`` in slices of at most ``size`` bytes (no copies)."""
    if len(data) <= size:
        return [data]
    mv = memoryview(data)
    return [mv[i : i + size] for i in range(0, len(mv), size)]


class ClientBase:
    """The configuration and the non-I/O logic of :class:`~ec_cache.Client` and
    :class:`~ec_cache.AsyncClient`."""

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        model: str,
        dtype: torch.dtype | str,
        timeouts: Timeouts | float | None,
        retries: Retries | int | None,
        limits: Limits | None,
        raise_on_unavailable: bool,
        verify: bool,
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
        self.results = BufferPool(self.limits.buffer_pool_bytes, pinned=False, steps=16)

    @property
    def own_transport(self) -> bool:
        """Whether the SDK's transport can serve every replica (``http://`` only)."""
        return all(u.startswith("http://") for u in self.router.urls)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def urls(self) -> list[str]:
        return list(self.router.urls)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.router.urls!r}, model={self.model!r}, "
            f"dtype={self.dtype!r})"
        )

    def _path(self, hash: str) -> str:
        return f"/ec/{self.model}/{self.dtype}/{check_hash(hash)}"

    def _exists_path(self) -> str:
        return f"/ec/{self.model}/{self.dtype}/_exists"

    def _order(self, hash: str) -> list[str]:
        return self.router.order(self.model, self.dtype, hash)

    def _put_headers(self, body: PutBody, conditional: bool) -> dict[str, str]:
        headers = body.headers()
        if conditional:
            # The server answers 412 before reading the body when the entry exists, and
            # with ``Expect`` the body is not even sent.
            headers["If-None-Match"] = "*"
            headers["Expect"] = "100-continue"
        return headers

    def _error_from(self, response: httpx.Response, body: bytes, url: str) -> BaseException:
        error = error_for(response, body, url)
        if response.status_code in self.retries.statuses:
            return RetryableStatus(error)
        return error

    def _is_miss(self, error: BaseException) -> bool:
        """Whether an error answer to a read counts as a miss (503 unless asked)."""
        return isinstance(error, UnavailableError) and not self.raise_on_unavailable

    def _receiver(
        self,
        response: httpx.Response,
        url: str,
        device: torch.device | None,
        out: torch.Tensor | None,
    ) -> Receiver:
        return Receiver(
            dtype=self.dtype,
            resp=response,
            url=url,
            device=device,
            out=out,
            pool=self.pool,
            results=self.results,
            verify=self.verify,
            max_bytes=self.limits.max_body_bytes,
        )

    def _timeout(self) -> httpx.Timeout:
        return self.timeouts.to_httpx()


def exists_batches(
    orders: Sequence[Sequence[str]], pending: Iterable[int], dead: set[str]
) -> list[tuple[str, list[int]]]:
    """Group keys (by index) under the first replica of their own order that is not
    ``dead``, in batches of at most ``EXISTS_BATCH``; a key with no live replica left
    raises ``ConnectError``."""
    groups: dict[str, list[int]] = {}
    for i in pending:
        order = orders[i]
        url = order[0]
        if url in dead:
            live = next((u for u in order if u not in dead), None)
            if live is None:
                raise ConnectError(f"no replica reachable: {', '.join(sorted(dead))}", url=url)
            url = live
        groups.setdefault(url, []).append(i)
    return [
        (url, indices[start : start + EXISTS_BATCH])
        for url, indices in groups.items()
        for start in range(0, len(indices), EXISTS_BATCH)
    ]


class RetryableStatus(Exception):
    """Internal: an answer whose status is in ``Retries.statuses``."""

    def __init__(self, error: ServerError) -> None:
        super().__init__(str(error))
        self.error = error


def to_ec_error(exc: BaseException | None, url: str) -> ECCacheError:
    """Map the last failure of a call to the SDK's exceptions."""
    if isinstance(exc, RetryableStatus):
        return exc.error
    if isinstance(exc, ECCacheError):
        return exc
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return ConnectError(f"cannot connect to {url}: {exc}", url=url)
    if isinstance(exc, httpx.TimeoutException):
        return TransportTimeout(f"{url}: {type(exc).__name__}: {exc}", url=url)
    return TransportError(f"{url}: {type(exc).__name__}: {exc}", url=url)


class Route:
    """How the SDK's transport reaches one replica without httpx building each request:
    the ``(host, port)``, the target's prefix (the base URL's path) and the request
    headers httpx itself would send there (``Host``, ``Accept``, ``User-Agent``,
    ``Authorization``, extra headers...), computed once from ``Client.build_request``."""

    __slots__ = ("headers", "key", "prefix")

    def __init__(self, key: tuple[str, int], prefix: bytes, headers: list[tuple[bytes, bytes]]):
        self.key = key
        self.prefix = prefix
        self.headers = headers

    def target(self, path: str) -> bytes:
        """The request target of ``path`` (a ``_path``: ASCII that httpx sends as is)."""
        return self.prefix + path.encode("ascii")


def direct_routes(http: httpx.Client | httpx.AsyncClient, urls: Iterable[str]) -> dict[str, Route]:
    """The :class:`Route` of each ``http://`` replica whose requests need nothing from
    httpx beyond their headers (no credentials or query in the URL)."""
    routes: dict[str, Route] = {}
    for url in urls:
        request = http.build_request("GET", url + "/ec")
        u = request.url
        if u.scheme != "http" or u.userinfo or u.query or not u.raw_path.endswith(b"/ec"):
            continue
        routes[url] = Route((u.host, u.port or 80), u.raw_path[:-3], list(request.headers.raw))
    return routes


_httpx_log = logging.getLogger("httpx")


def log_response(method: str, url: str, response: httpx.Response) -> None:
    """The line httpx logs for every response (INFO, logger ``httpx``), for the
    requests that the clients send without ``httpx.Client.send``."""
    if _httpx_log.isEnabledFor(logging.INFO):
        _httpx_log.info(
            'HTTP Request: %s %s "%s %d %s"',
            method,
            url,
            response.http_version,
            response.status_code,
            response.reason_phrase,
        )


class DiscardingCookieJar(http.cookiejar.CookieJar):
    """A cookie jar that keeps nothing, given to httpx's clients as their ``cookies``:
    ec-cache sets no cookies, so a ``Set-Cookie`` from a proxy in front of a server is
    never stored or sent back."""

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        return None

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None


def default_headers(token: str | None, extra: dict[str, str] | None) -> dict[str, str]:
    from . import __version__

    headers = {"User-Agent": f"ec-cache-python/{__version__}", "Accept-Encoding": "identity"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if extra:
        headers.update(extra)
    return headers


def error_for(resp: httpx.Response, body: bytes, url: str) -> ServerError:
    return ServerError.from_response(
        resp.status_code, body, url=url, retry_after=resp.headers.get("retry-after")
    )


def entry_info(hash: str, resp: httpx.Response, url: str) -> EntryInfo:
    h = resp.headers
    try:
        shape = parse_shape(h.get("x-ec-shape", ""))
        size = int(h.get("content-length", "0"))
    except ValueError as exc:
        raise IntegrityError(f"bad X-EC-Shape/Content-Length from {url}: {exc}") from None
    return EntryInfo(
        hash=hash,
        dtype=h.get("x-ec-dtype", ""),
        shape=shape,
        size=size,
        crc32c=h.get("x-ec-crc32c"),
        tier=h.get("x-ec-tier"),
        url=url,
    )


# -- PUT ------------------------------------------------------------------------------
class PutBody(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A PUT body: the safetensors header, then the tensor's own bytes (8 MiB slices of
    one ``memoryview``, so each socket write is bounded and progress can be shown).
    Re-iterable, so a retried PUT sends the same memory again."""

    def __init__(
        self,
        header: bytes,
        data: memoryview,
        *,
        keepalive: object,
        lease: PooledBuffer | None,
    ) -> None:
        self.header = header
        self.data = data
        self.length = len(header) + len(data)
        crc = Crc32c()
        crc.update(header)
        crc.update(data)
        self.crc32c = crc.hexdigest()
        self.progress: Progress | None = None
        self._keepalive = keepalive
        self._lease = lease

    def _chunks(self) -> list[bytes | memoryview]:
        return [self.header, *split_chunks(self.data)]

    def __iter__(self) -> Iterator[bytes]:
        done = 0
        for chunk in self._chunks():
            yield chunk  # type: ignore[misc]  # memoryviews: bytes-like, sent as they are
            done += len(chunk)
            if self.progress is not None:
                self.progress(done, self.length)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.__iter__():
            yield chunk

    def headers(self) -> dict[str, str]:
        return {
            "Content-Length": str(self.length),
            "Content-Type": "application/octet-stream",
            "X-EC-CRC32C": self.crc32c,
        }

    def release(self) -> None:
        lease, self._lease = self._lease, None
        self._keepalive = None
        if lease is not None:
            lease.release()


def encode_put(tensor: torch.Tensor, dtype: str, pool: BufferPool) -> PutBody:
    """The PUT body for ``tensor``: no copy for a contiguous CPU tensor, one
    ``.contiguous()`` for a strided one, one staging copy for a device tensor."""
    tensor = check_tensor(tensor, dtype)
    header = build_header(dtype, tuple(tensor.shape))
    if tensor.device.type == "cpu":
        contiguous = tensor if tensor.is_contiguous() else tensor.contiguous()
        return PutBody(header, tensor_memoryview(contiguous), keepalive=contiguous, lease=None)
    lease = _cuda.stage_to_host(tensor, pool)
    nbytes = tensor.numel() * tensor.element_size()
    return PutBody(header, lease.view(nbytes), keepalive=None, lease=lease)


# -- GET ------------------------------------------------------------------------------
class Receiver:
    """Receives one GET body (sans-I/O): the callers read the 8-byte prefix, then the
    header, then fill :meth:`plan`'s target, then call :meth:`finish`.

    The data goes straight into the destination when that is a contiguous CPU tensor
    (``out``, or a new one on memory from the ``results`` pool, which gets it back once
    the caller drops the tensor); otherwise into a pooled staging buffer (pinned when
    CUDA is available) followed by one copy to the device / into ``out``; to a
    contiguous CUDA destination that copy goes in sections queued as the body arrives
    (:meth:`landed`). The returned tensor never aliases a staging buffer.
    """

    def __init__(
        self,
        *,
        dtype: str,
        resp: httpx.Response,
        url: str,
        device: torch.device | str | None,
        out: torch.Tensor | None,
        pool: BufferPool,
        results: BufferPool,
        verify: bool,
        max_bytes: int,
    ) -> None:
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.url = url
        self.headers = resp.headers
        length = resp.headers.get("content-length")
        self.total = int(length) if length is not None and length.isdigit() else None
        self.out = out
        if device is None:
            self.device = out.device if out is not None else torch.device("cpu")
        else:
            self.device = torch.device(device)
        self.pool = pool
        self.results = results
        self.verify = verify
        self.crc = Crc32c()
        self.meta: TensorMeta | None = None
        self._result: torch.Tensor | None = None
        self._lease: PooledBuffer | None = None
        self._sections: _cuda.SectionCopy | None = None
        self.received = 0

    def header_length(self, prefix: bytes) -> int:
        return parse_header_length(prefix, self.total)

    def plan(self, header: bytes) -> memoryview:
        """Check the header against the client and the ``X-EC-*`` headers, and return
        the memory the tensor data must be received into."""
        meta = parse_header(header, total=self.total)
        if meta.total > self.max_bytes:
            raise IntegrityError(
                f"{self.url}: entry of {meta.total} bytes is larger than "
                f"Limits.max_body_bytes ({self.max_bytes})"
            )
        self.meta = meta
        h = self.headers
        if meta.dtype != self.dtype:
            raise IntegrityError(f"{self.url}: body holds {meta.dtype}, client wants {self.dtype}")
        wire_dtype = h.get("x-ec-dtype")
        if wire_dtype is not None and wire_dtype != meta.dtype:
            raise IntegrityError(f"X-EC-Dtype {wire_dtype} but body holds {meta.dtype}")
        wire_shape = h.get("x-ec-shape")
        if wire_shape is not None:
            try:
                shape = parse_shape(wire_shape)
            except ValueError:
                raise IntegrityError(f"bad X-EC-Shape {wire_shape!r}") from None
            if shape != meta.shape:
                raise IntegrityError(f"X-EC-Shape {wire_shape} but body holds {list(meta.shape)}")
        offset = h.get("x-ec-data-offset")
        if offset is not None and offset != str(meta.data_offset):
            raise IntegrityError(f"X-EC-Data-Offset {offset} but data starts at {meta.data_offset}")

        torch_dtype = DTYPES[meta.dtype][0]
        out = self.out
        if out is not None:
            if out.dtype != torch_dtype or tuple(out.shape) != meta.shape:
                raise InvalidTensorError(
                    f"out= is {out.dtype}{list(out.shape)}, entry is "
                    f"{torch_dtype}{list(meta.shape)}"
                )
            if out.device.type == "cpu" and out.is_contiguous():
                self._result = out
                return tensor_memoryview(out)
        elif self.device.type == "cpu":
            self._result = self.results.tensor(meta.shape, torch_dtype)
            return tensor_memoryview(self._result)
        self._lease = self.pool.acquire(meta.nbytes)
        if self._lease.tensor.is_pinned():
            dst = out
            if dst is None and self.device.type == "cuda":
                dst = torch.empty(meta.shape, dtype=torch_dtype, device=self.device)
            if dst is not None and dst.device.type == "cuda" and dst.is_contiguous():
                self._sections = _cuda.SectionCopy(self._lease, dst, meta.nbytes)
        return self._lease.view(meta.nbytes)

    def landed(self, filled: int) -> None:
        """The first ``filled`` bytes of :meth:`plan`'s target have arrived."""
        if self._sections is not None:
            self._sections.landed(filled)

    def finish(self) -> torch.Tensor:
        meta = self.meta
        assert meta is not None
        if self.verify:
            expected = self.headers.get("x-ec-crc32c")
            if expected is None:
                raise IntegrityError(f"{self.url}: response carries no X-EC-CRC32C")
            if expected.lower() != self.crc.hexdigest():
                raise IntegrityError(
                    f"{self.url}: CRC32C of the body is {self.crc.hexdigest()}, "
                    f"X-EC-CRC32C says {expected}"
                )
        if self._result is not None:
            return self._result
        if self._sections is not None:
            try:
                return self._sections.finish()
            finally:
                self.release()
        lease = self._lease
        assert lease is not None
        torch_dtype = DTYPES[meta.dtype][0]
        staged = typed_view(lease.tensor, meta.nbytes, torch_dtype, meta.shape)
        try:
            if self.out is not None and self.out.device.type == "cpu":
                self.out.copy_(staged)
                return self.out
            return _cuda.copy_to_device(
                staged, lease, self.out.device if self.out is not None else self.device, self.out
            )
        finally:
            self.release()

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            if self._sections is not None:
                self._sections.fence()
            lease.release()


def typed_view(
    raw: torch.Tensor, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """``raw[:nbytes]`` (uint8) seen as ``dtype`` of ``shape``, without copying."""
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    return raw[:nbytes].view(dtype).view(shape)


def check_body_end(extra: int) -> None:
    if extra:
        raise IntegrityError("body is longer than its safetensors header describes")


def exists_body(hashes: Sequence[str]) -> tuple[httpx.ByteStream, dict[str, str]]:
    """The body of ``POST .../_exists`` for checked ``hashes`` and its headers
    (re-iterable, for a resend). A checked hash (letters, digits, ``. _ : -``) is its own
    JSON string, so the list is joined rather than encoded (json.dumps escapes every
    character: 0.18 ms for 1000 hashes)."""
    listed = '","'.join(hashes).join(('["', '"]')) if hashes else "[]"
    content = f'{{"hashes":{listed}}}'.encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(content))}
    return httpx.ByteStream(content), headers


def json_body(resp_content: bytes, url: str) -> Any:
    """The answer's JSON; a ``TransportError`` for anything else (deep nesting too)."""
    try:
        return json.loads(resp_content)
    except (ValueError, RecursionError):
        raise TransportError(f"{url}: answer is not JSON", url=url) from None


def present_list(answer: Any, count: int, url: str) -> list[bool]:
    """The ``present`` list of an ``_exists`` answer: ``count`` JSON booleans, or a
    ``TransportError`` (never a string or number taken for a boolean)."""
    present = answer.get("present") if isinstance(answer, dict) else None
    if (
        not isinstance(present, list)
        or len(present) != count
        or not all(type(value) is bool for value in present)
    ):
        raise TransportError(f"{url}: malformed _exists answer", url=url)
    return present
