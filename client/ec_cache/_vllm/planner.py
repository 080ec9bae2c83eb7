"""The scheduler's side of asynchronous loads: which items the workers must prefetch
or release, and when a request that waits for them may run (no vLLM import).

Life of an item the scheduler found in ec-cache (``PrefetchStatus``)::

    ORDERED --shipped in a step's metadata--> SHIPPED --every rank holds it--> READY
                                                  |                               |
                      a rank failed, or past the deadline: FAILED (a miss)        |
                                                                                   v
                                       vLLM allocates it: the workers move it to the device

An item is released (the workers drop what they hold or fetch) when no request waits
for it any more: finished, aborted or preempted. The workers only see the metadata of
steps that run the model, and only report back from those steps; in a step that runs
nothing (the engine is idle but for the waiting requests) the items still in transit
turn SYNC: the request is scheduled and its workers load synchronously, which stalls
nobody since nothing else runs.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ec_cache._vllm.counters import Counters

__all__ = ["PrefetchOrder", "PrefetchPlanner", "PrefetchStatus"]


class PrefetchStatus(enum.Enum):
    ORDERED = "ordered"  # to be shipped to the workers with the next step
    SHIPPED = "shipped"  # the workers are fetching it
    READY = "ready"  # every rank holds it in host memory
    FAILED = "failed"  # a rank could not fetch it (or too late): a miss, computed
    SYNC = "sync"  # loaded synchronously when scheduled (the engine was idle)


# Statuses in which a worker may hold the item or be fetching it.
_ON_WORKERS = (PrefetchStatus.SHIPPED, PrefetchStatus.READY, PrefetchStatus.SYNC)


@dataclass(frozen=True)
class PrefetchOrder:
    """Scheduler -> workers: fetch this entry into host memory."""

    order_id: int  # names this order in the workers' reports (and its release)
    mm_hash: str
    key: str
    num_embeds: int | None
    width: int | None


@dataclass
class _Item:
    order: PrefetchOrder
    status: PrefetchStatus = PrefetchStatus.ORDERED
    waiters: set[str] = field(default_factory=set)  # request ids
    deadline: float | None = None  # set when shipped


# Added to the workers' own deadline before the scheduler gives up on an item, so
# that a worker's failure (with its reason, in its report) normally comes first.
REPORT_GRACE_S = 1.0


class PrefetchPlanner:
    """Per-item prefetch state of one scheduler. ``timeout_s``: the workers' deadline
    for a prefetch; a shipped item not ready on every rank ``REPORT_GRACE_S`` after
    it is given up (a miss)."""

    def __init__(
        self,
        *,
        timeout_s: float,
        counters: Counters,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._timeout = timeout_s
        self._counters = counters
        self._clock = clock
        self._items: dict[str, _Item] = {}
        self._by_order: dict[int, str] = {}
        self._releases: list[int] = []  # order ids to drop on the workers
        self._next_order = 0
        self._held_bytes = 0

    def status(self, mm_hash: str) -> PrefetchStatus | None:
        item = self._items.get(mm_hash)
        return item.status if item is not None else None

    def need(
        self,
        request_id: str,
        mm_hash: str,
        key: str,
        num_embeds: int | None,
        width: int | None,
    ) -> PrefetchStatus:
        """``request_id`` needs ``mm_hash`` (found in ec-cache): order it unless it is
        already known; returns its status."""
        item = self._items.get(mm_hash)
        if item is None:
            self._next_order += 1
            order = PrefetchOrder(self._next_order, mm_hash, key, num_embeds, width)
            item = self._items[mm_hash] = _Item(order)
            self._by_order[order.order_id] = mm_hash
        item.waiters.add(request_id)
        return item.status

    def allocated(self, mm_hash: str) -> PrefetchStatus | None:
        """vLLM allocated ``mm_hash`` in its encoder cache (loaded or computed): the
        item leaves the planner. An item still in transit is released."""
        item = self._items.get(mm_hash)
        if item is None:
            return None
        self._forget(item, release=item.status is PrefetchStatus.SHIPPED)
        return item.status

    def drop_request(self, request_id: str) -> None:
        """``request_id`` finished, was aborted or preempted: release every item that
        nobody else waits for."""
        for item in [i for i in self._items.values() if request_id in i.waiters]:
            item.waiters.discard(request_id)
            if item.waiters:
                continue
            on_workers = item.status in _ON_WORKERS
            if on_workers:
                self._counters.add("prefetch_released")
            self._forget(item, release=on_workers)

    def on_report(self, ready: Iterable[int], failed: Iterable[int], held_bytes: int) -> set[str]:
        """The workers' report (ranks merged): order ids every rank holds, order ids
        some rank failed. Returns the items that failed (now misses)."""
        if held_bytes != self._held_bytes:
            self._held_bytes = held_bytes
            self._counters.set("prefetch_bytes_held", held_bytes)
        for order_id in ready:
            item = self._item_of(order_id)
            if item is not None and item.status is PrefetchStatus.SHIPPED:
                item.status = PrefetchStatus.READY
                self._counters.add("prefetch_ready")
        lost: set[str] = set()
        for order_id in failed:
            item = self._item_of(order_id)
            if item is not None and item.status in (PrefetchStatus.SHIPPED, PrefetchStatus.READY):
                item.status = PrefetchStatus.FAILED
                self._counters.add("prefetch_failed")
                self._releases.append(order_id)  # for the ranks that did fetch it
                lost.add(item.order.mm_hash)
        return lost

    def end_step(self, delivered: bool) -> tuple[list[PrefetchOrder], list[int], set[str]]:
        """Close the step: the orders and releases to ship in its metadata when
        ``delivered`` (the workers will run it), and the items given up past their
        deadline (now misses). When not delivered, the items in transit turn SYNC."""
        now = self._clock()
        expired: set[str] = set()
        for item in self._items.values():
            if (
                item.status is PrefetchStatus.SHIPPED
                and item.deadline is not None
                and now >= item.deadline
            ):
                item.status = PrefetchStatus.FAILED
                self._counters.add("prefetch_failed")
                self._counters.add("prefetch_expired")
                self._releases.append(item.order.order_id)
                expired.add(item.order.mm_hash)
        if not delivered:
            for item in self._items.values():
                if item.status in (PrefetchStatus.ORDERED, PrefetchStatus.SHIPPED):
                    item.status = PrefetchStatus.SYNC
                    self._counters.add("prefetch_sync")
            return [], [], expired
        orders = []
        for item in self._items.values():
            if item.status is PrefetchStatus.ORDERED:
                item.status = PrefetchStatus.SHIPPED
                item.deadline = now + self._timeout + REPORT_GRACE_S
                orders.append(item.order)
        if orders:
            self._counters.add("prefetch_started", len(orders))
        releases, self._releases = self._releases, []
        return orders, releases, expired

    def _item_of(self, order_id: int) -> _Item | None:
        mm_hash = self._by_order.get(order_id)
        item = self._items.get(mm_hash) if mm_hash is not None else None
        return item if item is not None and item.order.order_id == order_id else None

    def _forget(self, item: _Item, *, release: bool) -> None:
        del self._items[item.order.mm_hash]
        self._by_order.pop(item.order.order_id, None)
        if release:
            self._releases.append(item.order.order_id)
