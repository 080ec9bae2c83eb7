"""The scheduler's question "is this encoder output in ec-cache?" (no vLLM import).

vLLM asks it inside its scheduling loop, where every millisecond spent waiting delays
the next token of every running request. So answers are kept (positives in a bounded
LRU, negatives for the step and ``miss_ttl_s``), a failing server is cut off by a
circuit breaker, and on a vLLM that lets the connector defer a request the question
goes to a background thread: the loop waits for it at most ``exists_wait_s`` and
otherwise defers the request until the answer is in. That thread asks one question
at a time, about everything queued meanwhile: a slow server gets one ``_exists`` in
flight from each scheduler, however many requests arrive.

With claims (encode once per cluster), a question may answer that another engine is
computing an item (:class:`Computing`). Such an item stays unanswered, so its request
stays deferred, while a waiting thread holds one ``_wait`` long-poll for it; it becomes
a hit when the entry lands, and a miss (computed here) when the claim ends without an
entry or ``claim_wait_s`` passes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ec_cache._vllm.breaker import CircuitBreaker
from ec_cache._vllm.counters import Counters
from ec_cache._vllm.ttl_cache import TTLCache

__all__ = ["Computing", "Existence"]


@dataclass(frozen=True)
class Computing:
    """An answer: another engine claimed the item; wait at most ``for_s`` seconds."""

    for_s: float


#: ``True``: in ec-cache; ``False``: compute it; :class:`Computing`: wait for it.
Answer = bool | Computing
#: Waits for items: ``True`` landed, ``False`` the claim ended without an entry,
#: ``None`` still being computed when the wait ended.
Wait = Callable[[list[str], float], list[bool | None]]

# One round trip's outcome: the answers (None when it failed), its error, its seconds.
_Outcome = tuple[list[Answer] | None, Exception | None, float]
# How many long-polls for claimed items one scheduler holds at once.
_WAITERS = 4


class Existence:
    """Answers about items, asked with ``ask(identifiers) -> [present, ...]`` where the
    scheduling loop waits for them, and with ``ask_in_background`` (default: ``ask``;
    with claims, a claim) where it does not; ``wait`` waits for items another engine
    computes, at most ``max_wait_s``.

    Only the scheduler's thread calls the methods; the background thread runs the
    round trips and hands their outcomes back under ``_cond``.
    """

    def __init__(
        self,
        ask: Callable[[list[str]], list[Answer]],
        *,
        breaker: CircuitBreaker,
        counters: Counters,
        hits: TTLCache[str, bool],
        misses: TTLCache[str, bool],
        on_failure: Callable[[Exception], None],
        ask_in_background: Callable[[list[str]], list[Answer]] | None = None,
        wait: Wait | None = None,
        max_wait_s: float = 0.0,
    ) -> None:
        self._ask = ask
        self._ask_in_background = ask_in_background or ask
        self._wait = wait
        self._max_wait_s = max_wait_s
        self._breaker = breaker
        self._counters = counters
        self._hits = hits
        self._misses = misses
        self._on_failure = on_failure
        self._step: dict[str, bool] = {}  # answers of this step
        # Misses that arrived in the background this step, kept one more step: the
        # request that asked may only look again then (even with miss_ttl_s 0).
        self._carry: dict[str, bool] = {}
        self._outage: set[str] = set()  # answered "miss" because of an outage
        self._carry_outage: set[str] = set()
        self._local: set[str] = set()  # answered from the LRU this step
        self._asking: set[str] = set()  # queued or in flight, not collected yet
        self._breaker_opened_seen = 0
        # Shared with the background thread:
        self._cond = threading.Condition()
        self._queued: dict[str, None] = {}  # to ask next, in order
        self._outcomes: list[tuple[list[str], _Outcome]] = []  # not collected yet
        self._answered: set[str] = set()  # the identifiers of those outcomes
        self._thread: threading.Thread | None = None
        self._closed = False
        # Items another engine computes: their waits' outcomes, not collected yet.
        self._waiting: set[str] = set()
        self._given_up: set[str] = set()  # waiting, but computed here meanwhile
        self._waited: list[tuple[list[str], list[bool | None] | None, float]] = []
        self._waiters = ThreadPoolExecutor(_WAITERS, thread_name_prefix="ec-cache-claim-wait")

    def known(self, identifier: str) -> bool | None:
        """The answer from local state, without the network (``None``: unknown)."""
        answer = self._step.get(identifier)
        if answer is not None:
            return answer
        if not self._breaker.healthy:
            if self._breaker.state == "half-open":
                return None  # the cooldown is over: let the next question probe
            self._step[identifier] = False
            self._outage.add(identifier)
            return False
        if self._hits.get(identifier):
            self._step[identifier] = True
            self._local.add(identifier)
            return True
        if self._misses.get(identifier):
            self._step[identifier] = False
            return False
        return None

    def is_outage(self, identifier: str) -> bool:
        """Whether this step's "miss" for ``identifier`` came from an outage."""
        return identifier in self._outage

    def take_local(self, identifier: str) -> bool:
        """Whether this step's answer for ``identifier`` came from the LRU (once)."""
        if identifier in self._local:
            self._local.discard(identifier)
            return True
        return False

    def is_asking(self, identifier: str) -> bool:
        return identifier in self._asking

    def is_waiting(self, identifier: str) -> bool:
        """Whether another engine computes ``identifier`` and a wait for it is out."""
        return identifier in self._waiting

    def stop_waiting(self, identifier: str) -> None:
        """This engine computes ``identifier`` after all (its request runs now); the
        wait's outcome, when it comes, is only remembered."""
        if identifier in self._waiting and identifier not in self._given_up:
            self._given_up.add(identifier)
            self._counters.add("claims_computed_after_wait")

    def ask(self, identifiers: Iterable[str]) -> None:
        """One blocking round trip for those of ``identifiers`` not answered yet."""
        todo = self._todo(identifiers)
        if todo and self._may_ask(todo):
            self._apply(todo, self._round_trip(todo, self._ask), carry=False)

    def ask_in_background(self, identifiers: Iterable[str], wait_s: float) -> None:
        """Queue those of ``identifiers`` neither answered nor asked yet for the
        background thread, and wait for their answer at most ``wait_s`` seconds."""
        todo = self._todo(identifiers)
        if not todo or not self._may_ask(todo):
            return
        self._asking.update(todo)
        deadline = time.monotonic() + wait_s
        with self._cond:
            self._queued.update(dict.fromkeys(todo))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ec-cache-exists", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
            while not self._answered.issuperset(todo) and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
        self.collect()

    def wait_for(self, identifier: str) -> None:
        """Block until the question about ``identifier`` is answered (each round
        trip is bounded by the client's timeouts)."""
        if identifier not in self._asking:
            return
        with self._cond:
            while identifier not in self._answered and not self._closed:
                self._cond.wait()
        self.collect()

    def wait_a_little(self, timeout: float) -> None:
        """With questions out, give the background thread up to ``timeout`` seconds
        (the scheduling loop spinning over deferred requests would starve it)."""
        if not self._asking:
            return
        with self._cond:
            if not self._outcomes:
                self._cond.wait(timeout)
        self.collect()

    def collect(self) -> None:
        """Take in the answers that came back."""
        with self._cond:
            outcomes, self._outcomes = self._outcomes, []
            waited, self._waited = self._waited, []
            self._answered.clear()
        for todo, outcome in outcomes:
            self._asking.difference_update(todo)
            self._apply(todo, outcome, carry=True)
        for identifiers, landed, seconds in waited:
            self._apply_wait(identifiers, landed, seconds)

    def forget_hit(self, identifier: str) -> None:
        """``identifier`` could not be loaded after all: a miss until ``miss_ttl_s``."""
        self._hits.discard(identifier)
        self._misses.put(identifier, True)
        self._step[identifier] = False
        self._carry.pop(identifier, None)

    def end_step(self) -> None:
        self._step, self._carry = self._carry, {}
        self._outage, self._carry_outage = self._carry_outage, set()
        self._local = set()

    def note_breaker(self) -> None:
        """Count the times the breaker opened since the previous call."""
        opened = self._breaker.opened
        if opened != self._breaker_opened_seen:
            self._counters.add("breaker_opened", opened - self._breaker_opened_seen)
            self._breaker_opened_seen = opened

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._waiters.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                todo, self._queued = list(self._queued), {}
            outcome = self._round_trip(todo, self._ask_in_background)
            with self._cond:
                self._outcomes.append((todo, outcome))
                self._answered.update(todo)
                self._cond.notify_all()

    def _todo(self, identifiers: Iterable[str]) -> list[str]:
        return list(
            dict.fromkeys(i for i in identifiers if i not in self._step and i not in self._asking)
        )

    def _may_ask(self, todo: list[str]) -> bool:
        """Whether the breaker lets a question through; if not, each item is an
        outage miss for this step."""
        if self._breaker.allow():
            return True
        self._record_outage(todo, carry=False)
        return False

    def _round_trip(self, todo: list[str], ask: Callable[[list[str]], list[Answer]]) -> _Outcome:
        started = time.monotonic()
        try:
            return ask(todo), None, time.monotonic() - started
        except Exception as exc:
            return None, exc, time.monotonic() - started

    def _apply(self, todo: list[str], outcome: _Outcome, *, carry: bool) -> None:
        answers, error, seconds = outcome
        if error is not None:
            self._breaker.record_failure()
            self._counters.add("exists_failed")
            self._on_failure(error)
        else:
            self._breaker.record_success()
        self._counters.add("exists_requests")
        self._counters.add("exists_seconds", seconds)
        self.note_breaker()
        if answers is None or len(answers) != len(todo):
            self._record_outage(todo, carry=carry)
            return
        computing: list[str] = []
        wait_s = 0.0
        for identifier, answer in zip(todo, answers, strict=True):
            if isinstance(answer, Computing) and self._wait is not None:
                computing.append(identifier)
                wait_s = max(wait_s, answer.for_s)
                continue
            present = answer is True
            self._step[identifier] = present
            if carry and not present:  # (positives stay in the LRU)
                self._carry[identifier] = present
            (self._hits if present else self._misses).put(identifier, True)
        if computing:
            self._start_wait(computing, min(wait_s, self._max_wait_s))

    def _start_wait(self, identifiers: list[str], wait_s: float) -> None:
        """Leave ``identifiers`` unanswered (their requests deferred) while one thread
        waits for them (``_wait``), at most ``wait_s`` seconds."""
        self._counters.add("claims_contended", len(identifiers))
        self._asking.update(identifiers)
        self._waiting.update(identifiers)
        wait = self._wait
        assert wait is not None

        def run() -> None:
            started = time.monotonic()
            try:
                landed: list[bool | None] | None = wait(identifiers, wait_s)
            except Exception as exc:
                self._on_failure(exc)
                landed = None
            with self._cond:
                self._waited.append((identifiers, landed, time.monotonic() - started))
                self._answered.update(identifiers)
                self._cond.notify_all()

        self._waiters.submit(run)

    def _apply_wait(
        self, identifiers: list[str], landed: list[bool | None] | None, seconds: float
    ) -> None:
        """A wait's outcome: a landed item is a hit; any other is computed here."""
        self._asking.difference_update(identifiers)
        self._waiting.difference_update(identifiers)
        self._counters.add("claims_wait_seconds", seconds * len(identifiers))
        outcomes = landed if landed is not None else [None] * len(identifiers)
        for identifier, present in zip(identifiers, outcomes, strict=True):
            if identifier in self._given_up:
                self._given_up.discard(identifier)
                if present is True:
                    self._hits.put(identifier, True)
                continue
            if present is True:
                self._counters.add("claims_landed")
                self._step[identifier] = True
                self._hits.put(identifier, True)
            else:
                self._counters.add("claims_computed_after_wait")
                self._step[identifier] = self._carry[identifier] = False
                self._misses.put(identifier, True)

    def _record_outage(self, todo: list[str], *, carry: bool) -> None:
        for identifier in todo:
            self._step[identifier] = False
            self._outage.add(identifier)
            if carry:
                self._carry[identifier] = False
                self._carry_outage.add(identifier)
