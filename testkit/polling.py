"""Waiting for a real process (or an event loop's tasks) to reach a state: a bounded
poll, never a timing check."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


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
    condition: Callable[[], object | Awaitable[object]],
    what: str,
    timeout: float = 30.0,
    interval: float = 0.001,
) -> None:
    """:func:`wait_for` inside an event loop: the loop's other tasks run meanwhile.
    ``condition`` may be a coroutine function (an HTTP call, say): it is awaited."""
    deadline = time.monotonic() + timeout
    while not await _outcome(condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


async def _outcome(value: object | Awaitable[object]) -> object:
    return await value if inspect.isawaitable(value) else value
