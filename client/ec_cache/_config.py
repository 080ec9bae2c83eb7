"""Small frozen configuration values for :class:`~ec_cache.Client`."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import httpx

__all__ = ["Limits", "Retries", "Timeouts", "backoff"]


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds allowed for each phase of one request; ``None`` waits forever.

    ``read`` and ``write`` bound each socket operation (one receive, one send of at
    most 8 MiB), not the whole transfer, so large tensors do not need large values.

    >>> Timeouts(connect=1.0, read=10.0)
    Timeouts(connect=1.0, read=10.0, write=30.0, pool=10.0)
    """

    connect: float | None = 3.0
    read: float | None = 30.0
    write: float | None = 30.0
    pool: float | None = 10.0

    @classmethod
    def of(cls, value: Timeouts | float | None) -> Timeouts:
        """``Timeouts`` from a number (every phase), ``None`` (no limit) or itself."""
        if isinstance(value, Timeouts):
            return value
        return cls(value, value, value, value)

    def to_httpx(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect, read=self.read, write=self.write, pool=self.pool)


def backoff(retry: int, base: float, cap: float) -> float:
    """``base * 2**(retry - 1)``, at most ``cap``: the delay before retry number ``retry``
    (from 1). The exponent stops at 30 (a float power overflows past 1023)."""
    return min(cap, base * 2.0 ** min(retry - 1, 30))


@dataclass(frozen=True, slots=True)
class Retries:
    """How failed requests are retried.

    ``attempts`` is the number of tries per request (1: no retry). A try fails on a
    transport error (connection refused/reset, timeout) or on a status in ``statuses``;
    before the next try the client sleeps ``backoff * 2**n`` seconds (jittered, capped
    at ``max_backoff``). Within one try a refused connection moves on to the next
    replica at once.

    Every ec-cache request is idempotent: GET/HEAD/DELETE/``_exists`` by nature, and
    PUT because entries are immutable and the first writer wins. A PUT whose first try
    reached the server but whose answer was lost is answered 200 on the retry, so
    ``put`` then returns ``False`` although this client created the entry. Set
    ``retry_put=False`` to never resend a PUT body (a refused connection is still
    tried on the next replica: nothing was sent).

    404, 4xx and 503 are answers, not failures, and are never retried (503 means
    "unknown"; for a cache a quick miss beats waiting).

    >>> Retries(attempts=5, backoff=0.2).attempts
    5
    """

    attempts: int = 3
    backoff: float = 0.05
    max_backoff: float = 2.0
    statuses: frozenset[int] = field(default_factory=lambda: frozenset({502, 504}))
    retry_put: bool = True

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("Retries.attempts must be >= 1")
        if self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("Retries backoff values must be >= 0")

    @classmethod
    def of(cls, value: Retries | int) -> Retries:
        """``Retries`` from an attempt count or itself."""
        return value if isinstance(value, Retries) else cls(attempts=value)

    def delay(self, retry: int) -> float:
        """Seconds to sleep before retry number ``retry`` (1-based), with full jitter
        on the upper half."""
        base = backoff(retry, self.backoff, self.max_backoff)
        return base / 2 + random.random() * base / 2


@dataclass(frozen=True, slots=True)
class Limits:
    """Concurrency and pooling.

    * ``concurrency``: requests in flight at once in ``get_many``/``put_many``.
    * ``max_connections``: requests in flight at once per replica, each on its own
      connection; one more waits for a free connection up to ``Timeouts.pool``.
    * ``max_keepalive``: idle keep-alive connections kept per replica.
    * ``keepalive_expiry``: seconds an idle connection is kept (below uvicorn's 5 s
      default so that the client drops it before the server does).
    * ``buffer_pool_bytes``: bytes of staging buffers (pinned when CUDA is present)
      kept for reuse between requests, and as many of memory freed by the CPU
      tensors ``get`` returned (from 1 MiB), which the next ``get`` reuses.
    * ``max_body_bytes``: largest entry a ``get`` accepts (a larger one, or a header
      describing one, is an ``IntegrityError`` before any memory is allocated).
    """

    concurrency: int = 8
    max_keepalive: int = 16
    keepalive_expiry: float = 4.0
    buffer_pool_bytes: int = 512 * 1024 * 1024
    max_connections: int = 100
    max_body_bytes: int = 16 * 1024**3

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("Limits.concurrency must be >= 1")
        if self.max_connections < 1:
            raise ValueError("Limits.max_connections must be >= 1")
