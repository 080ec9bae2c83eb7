"""Claims on missing keys: one client computes a new entry while the others wait.

When several engines meet a new image at once, each would miss and run the encoder. A
client that misses may instead *claim* the key for a lease (its expected encode-and-upload
time, at most ``EC_CLAIM_MAX_LEASE``); everyone else who asks learns that the key is
"computing" and when it is expected, and may wait for it (``_wait``) instead of
computing it too. A claim ends when the entry is stored through this replica, when its
owner releases it, or when its lease runs out.

Claims are advisory and live in this replica's memory only: the key's preferred replica
(rendezvous hashing, as for the entry itself) holds its claim. A lost claim (restart,
failover to another replica, a full table, an expired lease) costs at most a duplicate
encode; the entry itself is decided by the PUT path (first writer wins), never here.

Waiting is event-driven: a waiter registers one :class:`asyncio.Event` with each claim
it waits on and sleeps until one of them ends or the earliest lease runs out; there is
no polling on either side. The number of waiters per replica is bounded
(``EC_CLAIM_MAX_WAITERS``), and so is the number of live claims
(``EC_CLAIM_MAX_KEYS``): beyond it a claim is not granted and the asker computes, as it
would without claims.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from app.errors import Unavailable
from app.keys import EntryKey
from app.metrics import ClaimMetrics


class KeyState(StrEnum):
    """What an asker learns about a key."""

    ABSENT = "absent"
    PRESENT = "present"
    COMPUTING = "computing"


@dataclass(eq=False)  # hashed by identity: a waiter keeps the set of claims it watches
class Claim:
    """A live claim: who computes the key and until when (``time.monotonic``)."""

    owner: str
    expires_at: float
    #: The events of the waiters of this claim, set when it ends.
    watchers: set[asyncio.Event] = field(default_factory=set)

    def end(self) -> None:
        for event in self.watchers:
            event.set()
        self.watchers.clear()


@dataclass(frozen=True)
class ClaimAnswer:
    """One key's answer to a claim: ``granted`` is true when the asker now holds the
    claim; else ``state`` says why not, and ``expires_in`` (seconds) when it is
    computing elsewhere."""

    state: KeyState
    granted: bool = False
    expires_in: float | None = None


class TooManyWaiters(Unavailable):
    """``EC_CLAIM_MAX_WAITERS`` requests are already waiting on this replica."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"{limit} requests are already waiting for keys here", retry_after=1)


class Claims:
    """This replica's claims, by key. Every method runs on the event loop: a check and
    the grant that follows it are one step, so of many racing claimers exactly one wins.
    """

    def __init__(
        self,
        *,
        max_keys: int,
        max_lease: float,
        max_waiters: int,
        metrics: ClaimMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_keys = max_keys
        self.max_lease = max_lease
        self.max_waiters = max_waiters
        self.metrics = metrics
        self._clock = clock
        self._claims: dict[EntryKey, Claim] = {}
        self._waiters = 0
        metrics.watch(lambda: len(self._claims), lambda: self._waiters)

    def live(self, key: EntryKey) -> Claim | None:
        """The key's claim while its lease runs; an expired one is dropped (its waiters
        are woken then: they wake at the expiry themselves anyway)."""
        claim = self._claims.get(key)
        if claim is None:
            return None
        if claim.expires_at > self._clock():
            return claim
        self._drop(key, claim, "expired")
        return None

    def expires_in(self, claim: Claim) -> float:
        return max(0.0, claim.expires_at - self._clock())

    def claim(self, key: EntryKey, owner: str, lease: float) -> ClaimAnswer:
        """Grant ``key`` to ``owner`` for ``lease`` seconds (capped at ``max_lease``),
        unless another owner holds it. The caller has checked that the key is absent.
        Claiming again as the same owner renews the lease."""
        lease = min(lease, self.max_lease)
        current = self.live(key)
        if current is not None and current.owner != owner:
            self.metrics.claims.labels("computing").inc()
            return ClaimAnswer(KeyState.COMPUTING, expires_in=self.expires_in(current))
        if current is None and len(self._claims) >= self.max_keys:
            self._sweep()
            if len(self._claims) >= self.max_keys:
                self.metrics.claims.labels("full").inc()
                return ClaimAnswer(KeyState.ABSENT)
        if current is None:
            self._claims[key] = Claim(owner, self._clock() + lease)
        else:
            current.expires_at = self._clock() + lease
        self.metrics.claims.labels("granted").inc()
        return ClaimAnswer(KeyState.ABSENT, granted=True, expires_in=lease)

    def release(self, key: EntryKey, owner: str) -> bool:
        """End ``owner``'s claim on ``key`` (it gives up); False if it held none."""
        claim = self.live(key)
        if claim is None or claim.owner != owner:
            return False
        self._drop(key, claim, "released")
        return True

    def settle(self, key: EntryKey) -> None:
        """The entry was stored: whoever held the claim, it has ended."""
        claim = self._claims.get(key)
        if claim is not None:
            self._drop(key, claim, "stored")

    async def wait(self, keys: Sequence[EntryKey], timeout: float) -> None:
        """Return once none of ``keys`` has a live claim, or after ``timeout`` seconds.

        Raises :class:`TooManyWaiters` when ``max_waiters`` requests already wait. A
        waiter cancelled (its client went away) leaves nothing registered.
        """
        if not any(self.live(key) for key in keys):
            return
        if self._waiters >= self.max_waiters:
            self.metrics.waits.labels("refused").inc()
            raise TooManyWaiters(self.max_waiters)
        self._waiters += 1
        event = asyncio.Event()
        watched: set[Claim] = set()
        started = self._clock()
        deadline = started + timeout
        outcome = "gone"
        try:
            while True:
                claims = [claim for key in keys if (claim := self.live(key)) is not None]
                now = self._clock()
                if not claims or now >= deadline:
                    outcome = "timeout" if claims else "ended"
                    return
                event.clear()
                for claim in claims:
                    claim.watchers.add(event)
                watched.update(claims)
                wake_at = min(deadline, *(claim.expires_at for claim in claims))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), max(0.0, wake_at - now))
        finally:
            self._waiters -= 1
            for claim in watched:
                claim.watchers.discard(event)
            self.metrics.waits.labels(outcome).inc()
            self.metrics.wait_seconds.observe(self._clock() - started)

    def states(self, keys: Iterable[EntryKey], present: Iterable[bool]) -> list[ClaimAnswer]:
        """Each key's state given whether the store holds it: a stored entry is present
        whatever claim remains; else computing while claimed."""
        answers = []
        for key, stored in zip(keys, present, strict=True):
            claim = None if stored else self.live(key)
            if stored:
                answers.append(ClaimAnswer(KeyState.PRESENT))
            elif claim is None:
                answers.append(ClaimAnswer(KeyState.ABSENT))
            else:
                answers.append(ClaimAnswer(KeyState.COMPUTING, expires_in=self.expires_in(claim)))
        return answers

    def _drop(self, key: EntryKey, claim: Claim, reason: str) -> None:
        del self._claims[key]
        claim.end()
        self.metrics.ended.labels(reason).inc()

    def _sweep(self) -> None:
        now = self._clock()
        for key, claim in list(self._claims.items()):
            if claim.expires_at <= now:
                self._drop(key, claim, "expired")
