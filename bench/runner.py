"""Timing machinery: interleaved rounds of sequential requests, and N concurrent clients
(threads, or asyncio tasks on one event loop)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bench.stats import median, percentile

T = TypeVar("T")


@dataclass
class Contender:
    """One way of doing the operation. ``op(item)`` does request ``item`` and returns
    the number of payload bytes moved (0 for a lookup)."""

    label: str
    kind: str  # "ceiling", "ec-cache", "alternative", "diagnostic"
    op: Callable[[int], int]
    #: Outside the timed section, after each round: cleanup, drains...
    after_round: Callable[[], dict[str, Any] | None] | None = None
    note: str = ""
    #: Outside the timed section, before each request (e.g. wait for an idle server).
    before_each: Callable[[], None] | None = None


@dataclass
class Measured:
    label: str
    kind: str
    note: str
    raw_seconds: list[list[float]] = field(default_factory=list)
    round_bytes: list[int] = field(default_factory=list)
    after_round: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        flat = [s for r in self.raw_seconds for s in r]
        per_round = [
            b / sum(r) / 1e6 for b, r in zip(self.round_bytes, self.raw_seconds, strict=True)
        ]
        out: dict[str, Any] = {
            "label": self.label,
            "kind": self.kind,
            "note": self.note,
            "requests": len(flat),
            "p50_ms": median(flat) * 1e3,
            "p99_ms": percentile(flat, 99) * 1e3,
            "raw_seconds": [[round(s, 7) for s in r] for r in self.raw_seconds],
        }
        if any(self.round_bytes):
            out["mb_per_s_median"] = median(per_round)
            out["mb_per_s_rounds"] = [round(x, 1) for x in per_round]
        if self.after_round:
            out["after_round"] = self.after_round
        return out


def interleaved(
    contenders: Sequence[Contender],
    *,
    rounds: int,
    requests: int,
    warmup: int = 1,
) -> dict[str, dict[str, Any]]:
    """``rounds`` rounds; in each, every contender does ``requests`` sequential requests
    (``op(0..requests-1)``); the order of contenders rotates every round."""
    results = {c.label: Measured(c.label, c.kind, c.note) for c in contenders}
    for contender in contenders:  # connections, buffers, page cache
        for i in range(warmup):
            contender.op(i)
        if contender.after_round is not None:
            contender.after_round()
    for round_index in range(rounds):
        shift = round_index % len(contenders)
        order = list(contenders[shift:]) + list(contenders[:shift])
        if round_index % 2:
            order.reverse()
        for contender in order:
            seconds: list[float] = []
            moved = 0
            for i in range(requests):
                if contender.before_each is not None:
                    contender.before_each()
                start = time.perf_counter()
                moved += contender.op(i)
                seconds.append(time.perf_counter() - start)
            measured = results[contender.label]
            measured.raw_seconds.append(seconds)
            measured.round_bytes.append(moved)
            if contender.after_round is not None:
                extra = contender.after_round()
                if extra:
                    measured.after_round.append(extra)
    return {label: m.summary() for label, m in results.items()}


def concurrent(
    op: Callable[[int, int], int], clients: int, per_client: int
) -> tuple[float, list[float], int]:
    """``clients`` threads each doing ``per_client`` requests ``op(client, i)``; returns
    (wall seconds, per-request seconds, bytes moved)."""
    barrier = threading.Barrier(clients + 1)
    latencies: list[list[float]] = [[] for _ in range(clients)]
    moved = [0] * clients
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            barrier.wait()
            for i in range(per_client):
                start = time.perf_counter()
                moved[index] += op(index, i)
                latencies[index].append(time.perf_counter() - start)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return wall, [s for per in latencies for s in per], sum(moved)


class EventLoopThread:
    """One asyncio event loop running in a thread of its own, so that an
    ``AsyncClient`` (bound to its loop) keeps its connections between measurements."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def concurrent_tasks(
    loop: EventLoopThread,
    op: Callable[[int, int], Awaitable[int]],
    clients: int,
    per_client: int,
) -> tuple[float, list[float], int]:
    """``clients`` asyncio tasks on ``loop``, each awaiting ``per_client`` requests
    ``op(client, i)``; returns what :func:`concurrent` returns."""

    async def run_all() -> tuple[float, list[float], int]:
        latencies: list[list[float]] = [[] for _ in range(clients)]
        moved = [0] * clients

        async def task(index: int) -> None:
            for i in range(per_client):
                start = time.perf_counter()
                moved[index] += await op(index, i)
                latencies[index].append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(task(n) for n in range(clients)))
        wall = time.perf_counter() - start
        return wall, [s for per in latencies for s in per], sum(moved)

    return loop.run(run_all())
