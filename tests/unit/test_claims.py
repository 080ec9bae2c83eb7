"""app.claims on its own: grants, leases on a controlled clock, waiters and their bounds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from app.claims import Claims, KeyState, TooManyWaiters
from app.keys import EntryKey
from app.metrics import ClaimMetrics

pytestmark = pytest.mark.anyio

KEY = EntryKey("m", "float32", "a")
OTHER = EntryKey("m", "float32", "b")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def claims(clock: Callable[[], float] | None = None, **limits: int | float) -> Claims:
    settings: dict[str, int | float] = {"max_keys": 100, "max_lease": 60.0, "max_waiters": 10}
    settings.update(limits)
    registry = CollectorRegistry()
    return Claims(
        max_keys=int(settings["max_keys"]),
        max_lease=float(settings["max_lease"]),
        max_waiters=int(settings["max_waiters"]),
        metrics=ClaimMetrics(registry),
        clock=clock or Clock(),
    )


def metric(table: Claims, name: str, **labels: str) -> float:
    value = table.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_the_first_claimer_wins_and_the_others_learn_who_computes() -> None:
    table = claims()
    first = table.claim(KEY, "engine-a", 5)
    second = table.claim(KEY, "engine-b", 5)
    assert first.granted and first.expires_in == 5
    assert not second.granted and second.state is KeyState.COMPUTING
    assert second.expires_in == 5
    assert table.claim(KEY, "engine-a", 9).granted  # its owner renews
    assert table.states([KEY, OTHER], [False, False])[0].expires_in == 9
    assert metric(table, "ec_claims_total", outcome="granted") == 2
    assert metric(table, "ec_claims_total", outcome="computing") == 1


def test_a_lease_is_capped_and_ends_by_itself() -> None:
    clock = Clock()
    table = claims(clock, max_lease=2.0)
    assert table.claim(KEY, "engine-a", 3600).expires_in == 2.0
    clock.now += 1.9
    assert table.states([KEY], [False])[0].state is KeyState.COMPUTING
    clock.now += 0.1
    assert table.states([KEY], [False])[0].state is KeyState.ABSENT
    assert table.claim(KEY, "engine-b", 1).granted  # expired: another may claim
    assert metric(table, "ec_claims_ended_total", reason="expired") == 1


def test_a_stored_entry_is_present_whatever_claim_remains() -> None:
    table = claims()
    table.claim(KEY, "engine-a", 5)
    assert table.states([KEY], [True])[0].state is KeyState.PRESENT
    table.settle(KEY)
    assert table.live(KEY) is None
    assert metric(table, "ec_claims_ended_total", reason="stored") == 1


def test_only_the_owner_releases() -> None:
    table = claims()
    table.claim(KEY, "engine-a", 5)
    assert not table.release(KEY, "engine-b")
    assert table.live(KEY) is not None
    assert table.release(KEY, "engine-a")
    assert table.live(KEY) is None
    assert not table.release(KEY, "engine-a")


def test_a_full_table_grants_nothing_new_but_makes_room_from_expired_claims() -> None:
    clock = Clock()
    table = claims(clock, max_keys=1)
    assert table.claim(KEY, "engine-a", 1).granted
    refused = table.claim(OTHER, "engine-a", 1)
    assert not refused.granted and refused.state is KeyState.ABSENT
    assert metric(table, "ec_claims_total", outcome="full") == 1
    clock.now += 1
    assert table.claim(OTHER, "engine-a", 1).granted


async def test_waiters_wake_when_the_entry_is_stored() -> None:
    table = claims()
    table.claim(KEY, "engine-a", 30)
    waiters = [asyncio.create_task(table.wait([KEY], timeout=30)) for _ in range(5)]
    await asyncio.sleep(0)  # let them register
    assert metric(table, "ec_claim_waiters") == 5
    table.settle(KEY)
    await asyncio.wait_for(asyncio.gather(*waiters), timeout=10)
    assert metric(table, "ec_claim_waiters") == 0
    assert metric(table, "ec_claim_waits_total", outcome="ended") == 5


async def test_a_waiter_on_two_keys_waits_for_both() -> None:
    table = claims()
    table.claim(KEY, "engine-a", 30)
    table.claim(OTHER, "engine-b", 30)
    waiter = asyncio.create_task(table.wait([KEY, OTHER], timeout=30))
    await asyncio.sleep(0)
    table.release(KEY, "engine-a")
    await asyncio.sleep(0)
    assert not waiter.done()
    table.settle(OTHER)
    await asyncio.wait_for(waiter, timeout=10)


async def test_a_waiter_returns_at_its_timeout_with_the_claim_still_live() -> None:
    table = claims(time.monotonic)  # the timeout runs on the event loop's clock
    table.claim(KEY, "engine-a", 30)
    await table.wait([KEY], timeout=0.01)
    assert table.live(KEY) is not None
    assert metric(table, "ec_claim_waits_total", outcome="timeout") == 1


async def test_waiters_are_bounded_and_a_cancelled_one_leaves_nothing() -> None:
    table = claims(max_waiters=2)
    table.claim(KEY, "engine-a", 30)
    held = [asyncio.create_task(table.wait([KEY], timeout=30)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(TooManyWaiters):
        await table.wait([KEY], timeout=30)
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    claim = table.live(KEY)
    assert claim is not None and not claim.watchers
    assert metric(table, "ec_claim_waiters") == 0
    assert metric(table, "ec_claim_waits_total", outcome="gone") == 2
    assert metric(table, "ec_claim_waits_total", outcome="refused") == 1
    # An unclaimed key is not waited for at all, however many wait elsewhere.
    await table.wait([OTHER], timeout=30)
