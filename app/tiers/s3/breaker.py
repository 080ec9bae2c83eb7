"""The S3 tier's circuit breaker.

After an :class:`S3Unavailable`, calls fail at once for ``EC_S3_UNAVAILABLE_COOLDOWN``
seconds, so a dead endpoint costs each request no more than one timeout per cooldown
period; the first call after the cooldown probes the endpoint again, and any answer
from it closes the breaker: the tier recovers on its own, without a restart.
"""

from __future__ import annotations

import threading
import time

from app.tiers.s3.errors import S3Unavailable


class CircuitBreaker:
    """Open for ``cooldown`` seconds after each :meth:`mark_unavailable`. Thread-safe."""

    def __init__(self, cooldown: float) -> None:
        self.cooldown = cooldown
        self._lock = threading.Lock()
        self._unavailable_until = 0.0
        self._last_unavailable: str | None = None

    @property
    def available(self) -> bool:
        """False while the breaker is open (an unavailable error happened less than
        ``cooldown`` seconds ago)."""
        return time.monotonic() >= self._unavailable_until

    def retry_after(self) -> float:
        """Seconds a client should wait before retrying (for ``Retry-After``)."""
        return max(1.0, self._unavailable_until - time.monotonic(), self.cooldown)

    def mark_unavailable(self, reason: str | None = None) -> None:
        """Open the breaker for one cooldown period. ``reason`` is shown to every call
        refused meanwhile: nothing of the call that failed (``errors.outage_reason``)."""
        with self._lock:
            self._unavailable_until = time.monotonic() + self.cooldown
            if reason:
                self._last_unavailable = reason

    def mark_available(self) -> None:
        """The endpoint answered: close the breaker."""
        if self._unavailable_until:
            with self._lock:
                self._unavailable_until = 0.0

    def refusal(self, operation: str) -> S3Unavailable | None:
        """The error ``operation`` fails with at once while the breaker is open, else None."""
        if time.monotonic() < self._unavailable_until:
            return S3Unavailable(
                f"S3 {operation} skipped: endpoint marked unavailable "
                f"(last failure: {self._last_unavailable or 'unreachable'})",
                retry_after=self.retry_after(),
            )
        return None
