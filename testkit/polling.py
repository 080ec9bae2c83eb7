"""Waiting for a real process (or an event loop's tasks) to reach a state: a bounded
poll, never a timing check."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_for(
    condition: Callable[[], object], what: str, timeout: float = 30.0, interval: float = 0.05
) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


async def async_wait_for(
    condition: Callable[[], object], what: str, timeout: float = 30.0, interval: float = 0.001
) -> None:
    """:func:`wait_for` inside an event loop: the loop's other tasks run meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)
