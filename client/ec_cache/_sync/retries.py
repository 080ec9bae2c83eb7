# Generated from ec_cache/_async/retries.py by scripts/unasync.py; do not edit.
"""Retrying, the one way the SDK does it: a call made again after each failure for as
long as a policy answers a number of seconds to wait first. The clients' requests
follow :class:`~ec_cache.Retries`; the connector's loads retry until their deadline
(``ec_cache._vllm.prefetch.fetch_until``). The server's ``app/retries.py`` is the same
loop (a separate distribution, so a separate copy).

Written once, for asyncio, in ``ec_cache/_async/retries.py``; the blocking one in
``ec_cache/_sync/retries.py`` is generated from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from .._backends import sleep

__all__ = ["RetryPolicy", "retried"]

T = TypeVar("T")

RetryPolicy = Callable[[Exception, int], float | None]
"""Seconds to wait after failed attempt number ``attempt`` (from 1) before the next one,
or ``None``: give up, the failure is raised."""


def retried(call: Callable[[], T], delay: RetryPolicy) -> T:
    """``call()``, made again after each failure as ``delay`` says."""
    attempt = 0
    while True:
        try:
            return call()
        except Exception as exc:
            attempt += 1
            wait = delay(exc, attempt)
            if wait is None:
                raise
        sleep(wait)
