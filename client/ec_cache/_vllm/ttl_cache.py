"""The connector's bounded, expiring answers: cachetools' ``TTLCache`` (least recently
used first, each entry for a time to live) behind a lock, as cachetools caches are not
thread-safe (no vLLM import)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import cachetools

__all__ = ["TTLCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TTLCache(Generic[K, V]):
    """At most ``max_entries`` entries, each kept ``ttl`` seconds after it was put
    (``None``: until evicted); when full, the least recently used goes. A hit refreshes
    the entry's place in that order, not its expiry. ``max_entries=0`` keeps nothing.
    All methods are safe to call from several threads."""

    def __init__(
        self,
        max_entries: int,
        ttl: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0:
            raise ValueError("max_entries must be >= 0")
        if ttl is not None and ttl < 0:
            raise ValueError("ttl must be >= 0 or None")
        self._entries: cachetools.TTLCache[K, V] | None = None
        if max_entries:
            self._entries = cachetools.TTLCache(
                max_entries, math.inf if ttl is None else ttl, timer=clock
            )
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value for ``key``, or ``None`` when absent or expired."""
        if self._entries is None:
            return None
        with self._lock:
            value: V | None = self._entries.get(key)
        return value

    def put(self, key: K, value: V) -> None:
        if self._entries is None:
            return
        with self._lock:
            self._entries[key] = value

    def discard(self, key: K) -> None:
        if self._entries is None:
            return
        with self._lock:
            self._entries.pop(key, None)
