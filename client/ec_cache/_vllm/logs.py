"""The connector's log lines: the logger, warnings said once, and the periodic line of
lifetime totals (no vLLM import)."""

from __future__ import annotations

import logging
import time

from ec_cache._vllm.counters import Counters

__all__ = ["ConnectorLog", "logger"]

# A child of vLLM's "vllm" logger, so that vLLM's logging configuration shows it.
logger = logging.getLogger("vllm.ec_cache")


class ConnectorLog:
    """One role's warnings (each kind once) and, every ``interval_s``, one INFO line
    with its lifetime counters when they changed (vLLM's V1 model runner does not
    forward worker-side stats)."""

    def __init__(self, role: str, counters: Counters, interval_s: float) -> None:
        self._role = role
        self._counters = counters
        self._interval = interval_s
        self._warned: set[str] = set()
        self._last = time.monotonic()
        self._logged: dict[str, float] = {}

    def warn_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)

    def maybe_log_totals(self) -> None:
        if self._interval <= 0 or time.monotonic() - self._last < self._interval:
            return
        self._last = time.monotonic()
        totals = self._counters.totals()
        if totals != self._logged:
            self._logged = totals
            logger.info(
                "ec-cache connector (%s) totals: %s",
                self._role,
                ", ".join(f"{k}={round(v, 3)}" for k, v in sorted(totals.items())),
            )
