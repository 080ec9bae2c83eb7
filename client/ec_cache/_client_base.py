"""What :class:`~ec_cache.Client` and :class:`~ec_cache.AsyncClient` share besides
their I/O: the configuration, request paths and headers, and the choices made on
answers (what is a miss, which status is retried, how a body is received).

The I/O is written once, as asyncio code, in :mod:`ec_cache._async`;
:mod:`ec_cache._sync` is generated from it (``scripts/unasync.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

import httpx

from ._buffers import BufferPool
from ._call_limit import CallLimit
from ._claims import check_owner, default_owner
from ._config import Limits, Retries, Timeouts
from ._exceptions import UnavailableError
from ._failures import RetryableStatus, error_for
from ._receiver import Receiver
from ._routing import Router
from ._tensors import check_hash, check_model, parse_dtype

if TYPE_CHECKING:
    import torch

    from ._put_body import PutBody


Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called as a body goes out or comes in."""


Device: TypeAlias = "torch.device | str | int | None"
"""Where a result goes: a ``torch.device``, its name, or a CUDA ordinal."""


def device_of(device: Device) -> torch.device | None:
    """``device`` as a ``torch.device`` (an ordinal is a CUDA device); ``None`` stays."""
    if device is None:
        return None
    import torch

    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def default_headers(token: str | None, extra: dict[str, str] | None) -> dict[str, str]:
    """The headers of every request of a client: its user agent, ``identity`` (bodies are
    raw tensor bytes, never content-coded), its bearer token and the caller's ``extra``."""
    from . import __version__

    headers = {"User-Agent": f"ec-cache-python/{__version__}", "Accept-Encoding": "identity"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if extra:
        headers.update(extra)
    return headers


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
        owner: str | None,
    ) -> None:
        self.model = check_model(model)
        self.dtype = parse_dtype(dtype)
        self.router = Router([url] if isinstance(url, str) else url)
        self.timeouts = Timeouts() if timeouts is None else Timeouts.of(timeouts)
        self.retries = Retries() if retries is None else Retries.of(retries)
        self.limits = limits or Limits()
        self.raise_on_unavailable = raise_on_unavailable
        self.verify = verify
        self.owner = default_owner() if owner is None else check_owner(owner)
        self.pool = BufferPool(self.limits.buffer_pool_bytes)
        self.results = BufferPool(self.limits.buffer_pool_bytes, pinned=False, steps=16)

    @property
    def own_transport(self) -> bool:
        """Whether the SDK's transport can serve every replica (``http://`` only)."""
        return all(u.startswith("http://") for u in self.router.urls)

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
        return self._batch_path("_exists")

    def _batch_path(self, name: str) -> str:
        """A namespace's batch operation: ``_exists``, ``_claim``, ``_release``, ``_wait``."""
        return f"/ec/{self.model}/{self.dtype}/{name}"

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

    def _retry_delay(
        self, error: Exception, attempt: int, attempts: int, limit: CallLimit | None = None
    ) -> float | None:
        """Seconds before the next try of a request whose try number ``attempt`` (of
        ``attempts``) failed with ``error``; ``None``: give up. Transport errors and
        the statuses of ``Retries.statuses`` are retried, within the call's
        ``limit``."""
        if attempt >= attempts or not isinstance(error, httpx.TransportError | RetryableStatus):
            return None
        delay = self.retries.delay(attempt)
        left = None if limit is None else limit.left()
        return None if left is not None and left <= delay else delay

    def _phase_timeout(self, limit: CallLimit) -> httpx.Timeout:
        """The client's timeouts, none longer than what is left of ``limit``."""
        left, t = limit.left(), self.timeouts
        if left is None:
            return t.to_httpx()
        return httpx.Timeout(
            connect=left if t.connect is None else min(t.connect, left),
            read=left if t.read is None else min(t.read, left),
            write=left if t.write is None else min(t.write, left),
            pool=left if t.pool is None else min(t.pool, left),
        )

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
