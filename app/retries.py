"""Retrying, the one way the server does it: capped exponential backoff, and a call
retried in place as a policy says.

* :func:`backoff`: the delay before retry number ``attempt``, doubling from ``base`` up
  to ``cap``. Each user adds its own jitter: botocore's "standard" mode (the S3 tier's
  own requests, ``app.tiers.s3.errors.retry_delay``), the write-back queue's uploads and
  deletes, a purge's rounds.
* :func:`retried` (blocking, for a pool thread) and :func:`retried_async` (the event
  loop): ``call()`` again after each failure for as long as ``delay`` answers a number
  of seconds, and the failure raised when it answers None.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: Seconds to wait after failed attempt number ``attempt`` (from 1), or None: give up.
RetryPolicy = Callable[[Exception, int], float | None]


def backoff(attempt: int, base: float, cap: float) -> float:
    """``base * 2**(attempt - 1)``, at most ``cap``: the delay before retry ``attempt``
    (from 1). The exponent stops at 30 (a float power overflows past 1023)."""
    return min(cap, base * 2.0 ** min(attempt - 1, 30))


def retried(
    call: Callable[[], T], delay: RetryPolicy, rewind: Callable[[], object] | None = None
) -> T:
    """``call()``, retried after each failure as ``delay`` says; ``rewind`` runs before
    each retry (a body to send again from its start)."""
    attempt = 0
    while True:
        try:
            return call()
        except Exception as exc:
            attempt += 1
            wait = delay(exc, attempt)
            if wait is None:
                raise
            time.sleep(wait)
            if rewind is not None:
                rewind()


async def retried_async(call: Callable[[], Awaitable[T]], delay: RetryPolicy) -> T:
    """:func:`retried` on the event loop."""
    attempt = 0
    while True:
        try:
            return await call()
        except Exception as exc:
            attempt += 1
            wait = delay(exc, attempt)
            if wait is None:
                raise
            await asyncio.sleep(wait)
