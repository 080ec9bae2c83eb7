"""The connector's counters: added to from several threads, reported to vLLM per
interval and kept as lifetime totals (no vLLM import)."""

from __future__ import annotations

import threading

__all__ = ["Counters"]


class Counters:
    """Named integer/float counters, added to from several threads, and gauges.

    :meth:`take` returns what was added since the previous ``take`` (for vLLM's
    per-interval stats) while :meth:`totals` keeps growing for the process lifetime.
    A gauge (:meth:`set`) is a current value: both report the latest one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval: dict[str, float] = {}
        self._totals: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._interval[name] = self._interval.get(name, 0) + value
            self._totals[name] = self._totals.get(name, 0) + value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._interval[name] = value
            self._totals[name] = value

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._interval = self._interval, {}
            return out

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)
