"""The bound of one whole call (every try, replica, socket wait and body byte
included): a point in time, and a ``stop()`` the caller can flip from another thread.

Socket timeouts bound each receive, so a server that trickles a byte now and then
never trips them; a call given a ``timeout`` ends at its deadline wherever it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["STOP_POLL_S", "Deadline"]

# How often a waiting receive asks ``stop()``: how late a stopped call may end.
STOP_POLL_S = 0.05


class Deadline:
    """``timeout`` seconds from now (``None``: no limit) and ``stop``, asked every
    ``STOP_POLL_S`` while a socket waits (``None``: never stopped).

    >>> Deadline(None, None).wait(2.0)
    2.0
    >>> 0 < Deadline(1.0, None).wait(None) <= 1.0, Deadline(None, lambda: False).wait(None)
    (True, 0.05)
    """

    __slots__ = ("at", "stop")

    def __init__(self, timeout: float | None, stop: Callable[[], bool] | None) -> None:
        self.at = None if timeout is None else time.monotonic() + timeout
        self.stop = stop

    @classmethod
    def of(cls, timeout: float | None, stop: Callable[[], bool] | None) -> Deadline | None:
        return None if timeout is None and stop is None else cls(timeout, stop)

    def left(self) -> float | None:
        """Seconds left (``None``: no time limit; 0 once stopped)."""
        if self.stop is not None and self.stop():
            return 0.0
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def over(self) -> bool:
        """Whether the call must end now (past its deadline, or stopped)."""
        return (self.at is not None and time.monotonic() >= self.at) or bool(
            self.stop is not None and self.stop()
        )

    def wait(self, limit: float | None, *, poll: bool = True) -> float | None:
        """Seconds the next wait may take: ``limit`` (``None``: forever), within the
        deadline, and with ``poll`` at most ``STOP_POLL_S`` when it can be stopped
        (a wait that cannot be resumed, a connect, is not cut short). ``TimeoutError``
        when the call is over."""
        if self.over():
            raise TimeoutError("the call's timeout expired" if self.stop is None else "stopped")
        wait = limit
        if self.at is not None:
            left = self.at - time.monotonic()
            wait = left if wait is None else min(wait, left)
        if poll and self.stop is not None:
            wait = STOP_POLL_S if wait is None else min(wait, STOP_POLL_S)
        return wait
