"""The connector's scheduler role: "is this item in ec-cache?" for vLLM's scheduling
loop, the plan of the workers' prefetches, and the step's metadata for the workers.
Built by :class:`ec_cache.vllm.ECCacheConnector` in the scheduler process only.

vLLM calls ``ensure_cache_available(request, ...)`` before it looks at a request's
encoder inputs; ``False`` defers the request to a later step. The items of the request
still to be computed are asked about in ONE ``POST _exists``, on a background thread,
waited for at most ``exists_wait_s`` (then the request waits, not the scheduling loop).
Answers are kept: positives in a bounded LRU (entries are immutable), negatives for the
step and ``miss_ttl_s``. Failures feed a circuit breaker; while it is open every
question is answered "miss" without touching the network (:mod:`.existence`).

With ``load_mode: async`` and ``claims`` (the default), the question is a claim
(``POST _claim``; ``_exists`` with claims where this engine does not save): an item
nobody has becomes this engine's to compute and upload (the upload ends the claim), and
an item another engine is computing keeps its request deferred until it lands (a hit),
its claim ends without it, or ``claim_wait_s`` passes (then it is computed here). A
question that fails or times out is a miss, as without claims.

With ``load_mode: async`` an item found in ec-cache is ordered from the workers through
the step's metadata, and the request is deferred until every worker rank reports it in
host memory (the ranks' reports are merged by ``ECCacheWorkerReport.aggregate``); a
failed or late prefetch makes the item a miss, computed by the encoder
(:mod:`.planner`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ec_cache
from ec_cache._vllm.breaker import CircuitBreaker
from ec_cache._vllm.config import ECCacheConnectorConfig, make_client
from ec_cache._vllm.counters import Counters
from ec_cache._vllm.existence import Answer, Computing, Existence
from ec_cache._vllm.keys import cache_key, request_scoped
from ec_cache._vllm.logs import ConnectorLog
from ec_cache._vllm.messages import ECCacheConnectorMetadata, ECCacheLoad, ECCacheWorkerReport
from ec_cache._vllm.planner import PrefetchOrder, PrefetchPlanner, PrefetchStatus
from ec_cache._vllm.ttl_cache import TTLCache

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["ConnectorScheduler"]

# How long a step that runs nothing waits for an existence answer in flight.
_IDLE_STEP_WAIT_S = 0.001


def _num_embeds(request: Request, index: int) -> int | None:
    """The rows vLLM expects for item ``index`` of ``request`` (None: unknown)."""
    try:
        return int(request.get_num_encoder_embeds(index))
    except AttributeError:  # older vLLM
        try:
            return int(request.mm_features[index].mm_position.get_num_embeds())
        except AttributeError:
            return None


def _still_needed(request: Request, num_computed_tokens: int) -> list[int]:
    """Indexes of ``request``'s cacheable items not yet consumed by its prefill."""
    return [
        index
        for index, feature in enumerate(getattr(request, "mm_features", None) or ())
        if feature.mm_position.offset + feature.mm_position.length > num_computed_tokens
        and not request_scoped(feature.identifier)
    ]


def _answer(status: ec_cache.KeyStatus) -> Answer:
    if status.state == "present":
        return True
    if status.state == "computing":
        return Computing(status.expires_in or 0.0)
    return False  # absent: claimed by this engine (granted), or nobody could claim it


class ConnectorScheduler:
    """The scheduler's side of one connector. ``consumer``: whether this deployment
    loads (else every answer is "compute it"); ``saves``: whether its workers upload
    what the encoder computes (then it claims what it computes); ``async_loads``:
    whether items are prefetched before their request runs (claims need it);
    ``widths``: vLLM's measured encoder output widths per modality (producers only)."""

    def __init__(
        self,
        config: ECCacheConnectorConfig,
        model: str,
        dtype: str,
        *,
        consumer: bool,
        saves: bool,
        async_loads: bool,
        widths: dict[str, int],
        counters: Counters,
        log: ConnectorLog,
    ) -> None:
        self._consumer = consumer
        self._async_loads = async_loads
        self._widths = dict(widths)
        self._counters = counters
        self._exists_wait_s = config.exists_wait_s
        self._client: ec_cache.Client = make_client(
            config, model, dtype,
            timeout=config.exists_timeout_s, attempts=1,
            raise_on_unavailable=False, concurrency=1,
        )  # fmt: skip
        # Claims are asked in the background only, where a question defers just its
        # request (the loop waits exists_wait_s): worth a longer timeout, since a
        # timeout means encoding an item another engine may be computing.
        claims = config.claims and async_loads and consumer
        self._claims_granted = claims and saves
        self._claim_lease_s = config.claim_lease_s
        self._claims_client: ec_cache.Client | None = None
        if claims:
            self._claims_client = make_client(
                config, model, dtype,
                timeout=config.claim_timeout_s, attempts=1,
                raise_on_unavailable=False, concurrency=1,
            )  # fmt: skip
        self.breaker = CircuitBreaker(
            config.breaker_failures, config.breaker_cooldown_s, config.breaker_max_cooldown_s
        )
        self._existence = Existence(
            self._exists_many,
            breaker=self.breaker,
            counters=counters,
            hits=TTLCache(config.hit_cache_size, config.hit_ttl_s),
            misses=TTLCache(
                min(config.hit_cache_size, 8192) if config.miss_ttl_s > 0 else 0,
                config.miss_ttl_s,
            ),
            on_failure=lambda exc: log.warn_once(
                "exists",
                "ec-cache: existence check failed, answering 'miss' (%s); further "
                "failures are counted in exists_failed",
                exc,
            ),
            ask_in_background=self._claim_many if claims else None,
            wait=self._wait_many if claims else None,
            max_wait_s=config.claim_wait_s,
        )
        self._planner = PrefetchPlanner(timeout_s=config.load_timeout_s, counters=counters)
        self._promised: set[str] = set()  # has_cache_item said True this step
        self._resident: set[str] = set()  # in vLLM's encoder cache (alloc/free mirrored)
        self._deferred_since: dict[str, float] = {}  # request id -> first deferral
        self._pending_loads: dict[str, ECCacheLoad] = {}

    def _exists_many(self, identifiers: list[str]) -> list[Answer]:
        return list(self._client.exists_many([cache_key(i) for i in identifiers]))

    def _claim_many(self, identifiers: list[str]) -> list[Answer]:
        """Claim the missing items this engine will compute and upload; an engine
        that does not save only asks what is present or being computed."""
        client = self._claims_client
        assert client is not None
        keys = [cache_key(i) for i in identifiers]
        if not self._claims_granted:
            return [_answer(status) for status in client.status_many(keys)]
        statuses = client.claim_many(keys, lease=self._claim_lease_s)
        granted = sum(status.granted for status in statuses)
        if granted:
            self._counters.add("claims_granted", granted)
        return [_answer(status) for status in statuses]

    def _wait_many(self, identifiers: list[str], timeout: float) -> list[bool | None]:
        assert self._claims_client is not None
        keys = [cache_key(i) for i in identifiers]
        statuses = self._claims_client.wait_many(keys, timeout=timeout)
        return [{"present": True, "absent": False}.get(status.state) for status in statuses]

    def _width(self, request: Request, index: int) -> int | None:
        return self._widths.get(getattr(request.mm_features[index], "modality", ""))

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """``False`` defers ``request``: an existence answer or a prefetch it needs is
        not in yet. Requests without items in ec-cache are never deferred beyond the
        existence answer."""
        if not self._consumer:
            return True
        needed = _still_needed(request, num_computed_tokens)
        if not needed:
            return True
        existence = self._existence
        existence.collect()
        features = request.mm_features
        identifiers = [features[i].identifier for i in needed]
        unknown = [i for i in identifiers if existence.known(i) is None]
        if unknown:
            existence.ask_in_background(unknown, self._exists_wait_s)
        ready = True
        waiting = computing_here = False
        for index in needed:
            identifier = features[index].identifier
            present = existence.known(identifier)
            if present is None and existence.is_waiting(identifier):
                waiting = True  # another engine encodes it
            elif present is None:
                ready = False  # the answer is not in yet
            elif not present:
                computing_here = True
            elif self._async_loads and identifier not in self._resident:
                status = self._planner.need(
                    request.request_id,
                    identifier,
                    cache_key(identifier),
                    _num_embeds(request, index),
                    self._width(request, index),
                )
                ready &= status not in (PrefetchStatus.ORDERED, PrefetchStatus.SHIPPED)
        # A request whose encoder runs here anyway (an item this engine claimed) does
        # not wait for other engines' items: two engines that each claimed an item of
        # the same request would otherwise wait for each other until a lease ran out.
        # Its waited-for items are then computed here too (has_cache_item).
        ready &= not waiting or computing_here
        self._note_deferral(request.request_id, ready)
        return ready

    def _note_deferral(self, request_id: str, ready: bool) -> None:
        if not ready:
            self._deferred_since.setdefault(request_id, time.monotonic())
            return
        since = self._deferred_since.pop(request_id, None)
        if since is not None:
            self._counters.add("deferred_requests")
            self._counters.add("deferred_seconds", time.monotonic() - since)

    def has_cache_item(self, identifier: str) -> bool:
        """Whether vLLM may load ``identifier``'s encoder output instead of computing
        it in this step."""
        if not self._consumer:
            return False
        if request_scoped(identifier):
            self._counters.add("misses_request_scoped")
            return False
        existence = self._existence
        existence.collect()
        answer = existence.known(identifier)
        if answer is None and existence.is_waiting(identifier):
            existence.stop_waiting(identifier)  # its request runs now: compute it
            answer = False
        elif answer is None:  # a vLLM that did not call ensure_cache_available first
            if existence.is_asking(identifier):
                existence.wait_for(identifier)
            else:
                existence.ask([identifier])
            answer = bool(existence.known(identifier))
        if answer and self._async_loads and identifier not in self._resident:
            # Not planned (no ensure_cache_available): a synchronous load.
            status = self._planner.status(identifier)
            answer = status in (None, PrefetchStatus.READY, PrefetchStatus.SYNC)
        self._counters.add("hits" if answer else "misses")
        if answer:
            self._promised.add(identifier)
            if existence.take_local(identifier):
                self._counters.add("hits_local")
        elif existence.is_outage(identifier):
            self._counters.add("misses_outage")
        return answer

    def has_caches(self, request: Request) -> list[bool]:
        """vLLM 0.11.1-0.14 spelling of the scheduler question: one answer per item
        of ``request``, asked in one round trip. (Not tested: see docs/vllm.md.)"""
        identifiers = [f.identifier for f in getattr(request, "mm_features", None) or ()]
        if not self._consumer:
            return [False] * len(identifiers)
        self._existence.ask(
            i for i in identifiers if not request_scoped(i) and self._existence.known(i) is None
        )
        return [self.has_cache_item(i) for i in identifiers]

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """vLLM allocated item ``index`` of ``request`` (to load or to compute): queue
        its load when this step promised it."""
        if not self._consumer:
            return
        identifier = request.mm_features[index].identifier
        self._resident.add(identifier)
        self._planner.allocated(identifier)
        if identifier not in self._promised or identifier in self._pending_loads:
            return
        self._pending_loads[identifier] = ECCacheLoad(
            mm_hash=identifier,
            key=cache_key(identifier),
            num_embeds=_num_embeds(request, index),
            width=self._width(request, index),
            req_id=request.request_id,
            input_id=index,
        )

    def build_connector_meta(self, scheduler_output: Any) -> ECCacheConnectorMetadata:
        for mm_hash in getattr(scheduler_output, "free_encoder_mm_hashes", None) or ():
            self._resident.discard(mm_hash)
        for request_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._planner.drop_request(request_id)
        # The workers see this metadata only when the step runs the model.
        runs = getattr(scheduler_output, "total_num_scheduled_tokens", 1) > 0
        if not runs:
            # Only deferred requests: give the background question a moment, as
            # vLLM's engine loop sleeps 1 ms after such a step (its offline loop
            # does not, and would keep the GIL from the question's thread).
            self._existence.wait_a_little(_IDLE_STEP_WAIT_S)
        orders: list[PrefetchOrder] = []
        releases: list[int] = []
        if self._async_loads:
            orders, releases, expired = self._planner.end_step(runs)
            for mm_hash in expired:
                self._existence.forget_hit(mm_hash)
        meta = ECCacheConnectorMetadata(
            loads=list(self._pending_loads.values()),
            scheduled_encoder_inputs=getattr(scheduler_output, "scheduled_encoder_inputs", None),
            prefetch=orders,
            release=releases,
        )
        self._pending_loads = {}
        self._promised = set()
        self._existence.end_step()
        return meta

    def update_connector_output(self, report: ECCacheWorkerReport) -> None:
        """The workers' merged report: prefetches now held by every rank, and those
        that failed (misses from now on)."""
        if self._async_loads:
            for mm_hash in self._planner.on_report(report.ready, report.failed, report.held_bytes):
                self._existence.forget_hit(mm_hash)

    def request_finished(self, request_id: str) -> None:
        """Release the prefetches nobody else waits for (finished or aborted)."""
        self._planner.drop_request(request_id)
        self._deferred_since.pop(request_id, None)

    def note_stats(self) -> None:
        """Before the interval's counters are taken: the breaker's openings."""
        self._existence.note_breaker()

    def close(self) -> None:
        self._existence.close()
        self._client.close()
        if self._claims_client is not None:
            self._claims_client.close()
