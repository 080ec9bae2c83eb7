"""A scheduler connector and its worker connectors driven the way vLLM 0.33 drives
them, step by step, with vLLM's own pieces where they exist:

* scheduler side: what ``Scheduler.schedule`` does with the connector (defer a request
  when ``ensure_cache_available`` says so; ``has_cache_item`` and
  ``update_state_after_alloc`` for its items; ``build_connector_meta``);
* worker side: vLLM's ``ECConnectorModelRunnerMixin`` context (binds the metadata,
  ``start_load_caches``, ``build_connector_worker_meta``), entered only in steps that
  run the model, as vLLM's model runner does;
* back: vLLM's ``ECOutputAggregator`` merges the ranks' outputs, and the scheduler
  gets them through ``update_connector_output``.

The scheduler output is pickled on its way to each worker, as vLLM's executors do.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from ec_cache.vllm import ECCacheConnector
from vllm.distributed.ec_transfer import ec_transfer_state
from vllm.distributed.ec_transfer.ec_connector.utils import ECOutputAggregator
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin


@dataclass
class Step:
    output: SchedulerOutput
    scheduled: list[str] = field(default_factory=list)  # request ids
    deferred: list[str] = field(default_factory=list)
    computed: dict[str, list[int]] = field(default_factory=dict)  # request id -> items


class EngineLoop:
    """One scheduler connector, its workers (one per tensor-parallel rank), and each
    worker's ``encoder_cache``."""

    def __init__(
        self,
        sched: ECCacheConnector,
        workers: list[ECCacheConnector],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        self.sched = sched
        self.workers = workers
        self.caches: list[dict[str, torch.Tensor]] = [{} for _ in workers]
        self._monkeypatch = monkeypatch

    def schedule(
        self,
        requests: list[Request],
        *,
        others_running: bool = True,
        chunk: dict[str, list[int]] | None = None,
        preempted: set[str] | None = None,
        freed: set[str] | None = None,
    ) -> Step:
        """One scheduling step over ``requests``. ``others_running``: requests not
        shown here run in this step (the model runs even if all of these wait).
        ``chunk``: the items this step's prefill chunk of a request covers (default:
        all). ``preempted``: requests vLLM preempted in this step. ``freed``: items
        vLLM dropped from its encoder cache in this step."""
        out = SchedulerOutput.make_empty()
        out.preempted_req_ids = set(preempted or ())
        out.free_encoder_mm_hashes = sorted(freed or ())
        for cache in self.caches:
            for mm_hash in freed or ():
                cache.pop(mm_hash, None)
        step = Step(out)
        for req in requests:
            if not self.sched.ensure_cache_available(req, req.num_computed_tokens):
                step.deferred.append(req.request_id)
                continue
            step.scheduled.append(req.request_id)
            computed = []
            items = (chunk or {}).get(req.request_id, range(len(req.mm_features)))
            for i in items:
                if not self.sched.has_cache_item(req.mm_features[i].identifier):
                    computed.append(i)
                self.sched.update_state_after_alloc(req, i)
            if computed:
                out.scheduled_encoder_inputs[req.request_id] = computed
                step.computed[req.request_id] = computed
        out.total_num_scheduled_tokens = int(others_running) + len(step.scheduled)
        out.ec_connector_metadata = self.sched.build_connector_meta(out)
        return step

    def execute(self, step: Step) -> list[SchedulerOutput]:
        """The workers run ``step`` (nothing happens when it runs no tokens) and the
        scheduler gets their merged output. Returns what each worker received."""
        if step.output.total_num_scheduled_tokens == 0:
            return []
        shipped_outputs = []
        outputs: list[ModelRunnerOutput | None] = []
        for worker, cache in zip(self.workers, self.caches, strict=True):
            shipped: SchedulerOutput = pickle.loads(pickle.dumps(step.output))
            shipped_outputs.append(shipped)
            self._monkeypatch.setattr(ec_transfer_state, "_EC_CONNECTOR_AGENT", worker)
            with ECConnectorModelRunnerMixin.maybe_get_ec_connector_output(
                shipped, encoder_cache=cache
            ) as ec_output:
                pass
            outputs.append(
                ModelRunnerOutput(req_ids=[], req_id_to_index={}, ec_connector_output=ec_output)
            )
        merged = ECOutputAggregator().aggregate(pickle.loads(pickle.dumps(outputs)))
        if merged is not None and merged.ec_connector_output is not None:
            self.sched.update_connector_output(merged.ec_connector_output)
        return shipped_outputs

    def run(self, requests: list[Request], **schedule: Any) -> Step:
        step = self.schedule(requests, **schedule)
        self.execute(step)
        return step

    def run_until_scheduled(
        self, requests: list[Request], limit_s: float = 20.0, **schedule: Any
    ) -> Step:
        """Steps (others running) until none of ``requests`` is deferred."""
        deadline = time.monotonic() + limit_s
        while True:
            step = self.run(requests, **schedule)
            if not step.deferred:
                return step
            assert time.monotonic() < deadline, f"still deferred after {limit_s} s"
            time.sleep(0.01)
