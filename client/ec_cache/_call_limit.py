"""The bound of one whole call (every try, replica, socket wait and body byte
included): a point in time, a ``stop()`` the caller can flip from another thread, and
a floor under the rate of the body.

Socket timeouts bound each receive, so a server that trickles a byte now and then
never trips them; a call given a ``timeout`` ends at its deadline wherever it is, and
one given ``min_rate`` ends as soon as its body falls below that rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["RATE_GRACE_S", "STOP_POLL_S", "CallLimit"]

# How often a waiting receive asks ``stop()`` and checks the rate: how late a stopped
# or too slow call may end.
STOP_POLL_S = 0.05
# The body's rate is judged from this long after its first byte was due (the head
# arrived) on, so that a short stall at its start is no failure.
RATE_GRACE_S = 1.0


class CallLimit:
    """``timeout`` seconds from now (``None``: no limit); ``stop``, asked every
    ``STOP_POLL_S`` while a socket waits (``None``: never stopped); ``min_rate``, the
    bytes per second a body must average from ``RATE_GRACE_S`` after its head came
    (``None``: no floor).

    >>> CallLimit(None, None).wait(2.0)
    2.0
    >>> 0 < CallLimit(1.0, None).wait(None) <= 1.0, CallLimit(None, lambda: False).wait(None)
    (True, 0.05)
    """

    __slots__ = ("_body_bytes", "_body_from", "_too_slow", "at", "min_rate", "stop")

    def __init__(
        self,
        timeout: float | None,
        stop: Callable[[], bool] | None = None,
        min_rate: float | None = None,
    ) -> None:
        self.at = None if timeout is None else time.monotonic() + timeout
        self.stop = stop
        self.min_rate = min_rate
        self._body_from: float | None = None
        self._body_bytes = 0
        self._too_slow: str | None = None  # once too slow, the call is over

    @classmethod
    def of(
        cls,
        timeout: float | None,
        stop: Callable[[], bool] | None,
        min_rate: float | None = None,
    ) -> CallLimit | None:
        if timeout is None and stop is None and not min_rate:
            return None
        return cls(timeout, stop, min_rate or None)

    def body_started(self) -> None:
        """A response head came: the rate of what follows is judged from now on."""
        self._body_from = time.monotonic()
        self._body_bytes = 0

    def received(self, nbytes: int) -> None:
        self._body_bytes += nbytes

    def left(self) -> float | None:
        """Seconds left (``None``: no time limit; 0 once stopped or too slow)."""
        if self._too_slow is not None or (self.stop is not None and self.stop()):
            return 0.0
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def why_over(self) -> str | None:
        """Why the call must end now (past its deadline, stopped, too slow), or None."""
        now = time.monotonic()
        if self.at is not None and now >= self.at:
            return "the call's timeout expired"
        if self.stop is not None and self.stop():
            return "stopped by the caller"
        if self._too_slow is None and self.min_rate is not None and self._body_from is not None:
            elapsed = now - self._body_from
            if elapsed >= RATE_GRACE_S and self._body_bytes < self.min_rate * elapsed:
                self._too_slow = (
                    f"body slower than {self.min_rate:.0f} bytes/s "
                    f"({self._body_bytes} bytes in {elapsed:.1f} s)"
                )
        return self._too_slow

    def wait(self, limit: float | None, *, poll: bool = True) -> float | None:
        """Seconds the next wait may take: ``limit`` (``None``: forever), within the
        deadline, and with ``poll`` at most ``STOP_POLL_S`` when there is a stop or a
        rate to check (a wait that cannot be resumed, a connect, is not cut short).
        ``TimeoutError`` when the call is over."""
        why = self.why_over()
        if why is not None:
            raise TimeoutError(why)
        wait = limit
        if self.at is not None:
            left = self.at - time.monotonic()
            wait = left if wait is None else min(wait, left)
        if poll and (self.stop is not None or self.min_rate is not None):
            wait = STOP_POLL_S if wait is None else min(wait, STOP_POLL_S)
        return wait
