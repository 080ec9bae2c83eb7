"""The circuit breaker that cuts the scheduler's existence questions off a failing
server (no vLLM import)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["CircuitBreaker"]


class CircuitBreaker:
    """Stops calls to a failing server for a while, with exponential backoff.

    * closed: calls go through; ``failure_threshold`` consecutive failures open it.
    * open: :meth:`allow` answers ``False`` until ``cooldown`` seconds have passed.
    * half-open: after the cooldown, one caller is let through as a probe; its success
      closes the breaker, its failure opens it again with the cooldown doubled (up to
      ``max_cooldown``).
    """

    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown: float = 1.0,
        max_cooldown: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        if cooldown < 0 or max_cooldown < cooldown:
            raise ValueError("need 0 <= cooldown <= max_cooldown")
        self._threshold = failure_threshold
        self._base = cooldown
        self._max = max_cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None
        self._cooldown = cooldown
        self._probing = False
        self.opened = 0  # times the breaker went from closed/half-open to open

    @property
    def state(self) -> str:
        with self._lock:
            if self._open_until is None:
                return "closed"
            if self._clock() < self._open_until:
                return "open"
            return "half-open"

    @property
    def healthy(self) -> bool:
        """``True`` while closed: the server answered the last calls."""
        with self._lock:
            return self._open_until is None

    def allow(self) -> bool:
        """Whether a call may go to the server now."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._clock() < self._open_until or self._probing:
                return False
            self._probing = True  # this caller is the half-open probe
            return True

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._open_until = None
            self._cooldown = self._base
            self._probing = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._open_until is not None:
                # The half-open probe failed: back off further.
                self._cooldown = min(self._max, self._cooldown * 2)
            elif self._failures < self._threshold:
                return
            self._open_until = self._clock() + self._cooldown
            self._probing = False
            self.opened += 1
