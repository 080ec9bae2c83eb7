"""Small thread-safe building blocks of the vLLM connector (no vLLM import)."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from ec_cache._keys import hash_error

__all__ = ["CircuitBreaker", "Counters", "TTLCache", "cache_key", "request_scoped"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


#: How vLLM (0.32, 0.33: ``vllm/renderers/base.py``) names an item it did not hash: with
#: both its multimodal processor cache (``--mm-processor-cache-gb 0``) and prefix caching
#: off, an item without a user-supplied ``multi_modal_uuids`` value is named after its
#: request's place in the server's count, ``renderer{rank}-mm-{n}-{modality}-{i}``. Such
#: a name says nothing of the content, and every fresh server counts from 1 again.
_REQUEST_SCOPED = re.compile(r"renderer\d+-mm-\d+-\w+-\d+")


def request_scoped(identifier: str) -> bool:
    """Whether ``identifier`` names a request's item rather than its content: never
    looked up or saved (another server's item of that name is another image)."""
    return _REQUEST_SCOPED.fullmatch(identifier) is not None


def cache_key(identifier: str) -> str:
    """The ``{hash}`` segment under which vLLM's multimodal ``identifier`` is stored.

    vLLM's own ids (64/128 hex chars, ``"{lora_name}:{hash}"``) and most user UUIDs are
    valid on the wire and used as they are, so ``curl`` and the
    CLI see the same key vLLM logs. Anything else (a LoRA name with ``/`` or spaces, a
    user id longer than 256 chars, non-ASCII) becomes ``"sha256:" + hexdigest(id)``:
    deterministic, so every worker maps it to the same entry.
    """
    if hash_error(identifier) is None:
        return identifier
    return "sha256:" + hashlib.sha256(identifier.encode("utf-8")).hexdigest()


class TTLCache(Generic[K, V]):
    """A bounded LRU map whose entries also expire ``ttl`` seconds after insertion.

    ``ttl=None`` keeps entries until evicted by size; ``max_entries=0`` disables the
    cache. All methods are safe to call from several threads.
    """

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
        self._max = max_entries
        self._ttl = ttl
        self._clock = clock
        self._data: OrderedDict[K, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def get(self, key: K) -> V | None:
        """The value for ``key``, or ``None`` when absent or expired (a hit refreshes
        the LRU position, not the expiry)."""
        with self._lock:
            item = self._data.get(key)
            if item is None:
                return None
            expires, value = item
            if self._ttl is not None and self._clock() >= expires:
                del self._data[key]
                return None
            self._data.move_to_end(key)
            return value

    def __contains__(self, key: object) -> bool:
        return self.get(key) is not None  # type: ignore[arg-type]

    def put(self, key: K, value: V) -> None:
        if self._max == 0:
            return
        expires = self._clock() + self._ttl if self._ttl is not None else float("inf")
        with self._lock:
            self._data[key] = (expires, value)
            self._data.move_to_end(key)
            while len(self._data) > self._max:
                self._data.popitem(last=False)

    def discard(self, key: K) -> None:
        with self._lock:
            self._data.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


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
