"""Requests, entries and namespaces shared by the connector tests (vLLM 0.33's classes,
a real server through plain HTTP)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
from conftest import Server
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

if TYPE_CHECKING:
    from ec_cache._vllm.breaker import CircuitBreaker
    from ec_cache._vllm.prefetch import Prefetcher
    from ec_cache.vllm import ECCacheConnector

SCHED = ECConnectorRole.SCHEDULER
WORKER = ECConnectorRole.WORKER
DTYPE = "bfloat16"


def ns() -> str:
    """A fresh model namespace per test (the session server is shared)."""
    return f"test/vl-{uuid.uuid4().hex[:8]}"


def mm_hash() -> str:
    return uuid.uuid4().hex + uuid.uuid4().hex  # 64 hex chars, like vLLM's blake3


def make_request(identifiers: list[str], *, rows: int = 16, req_id: str | None = None) -> Request:
    """A vLLM request with one image placeholder of ``rows`` tokens per identifier."""
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=ident,
            mm_position=PlaceholderRange(offset=2 + i * (rows + 2), length=rows),
        )
        for i, ident in enumerate(identifiers)
    ]
    n = 4 + len(identifiers) * (rows + 2)
    return Request(
        req_id or f"req-{uuid.uuid4().hex[:6]}",
        [0] * n,
        SamplingParams(max_tokens=1),
        None,
        mm_features=features,
    )


def put_raw(server: Server, model: str, key: str, tensor: torch.Tensor) -> int:
    """Store an entry with plain HTTP (not through the connector)."""
    body = safetensors.torch.save({"t": tensor.contiguous()})
    with server.http() as c:
        r = c.put(f"/ec/{model}/{DTYPE}/{key}", content=body)
    assert r.status_code in (200, 201), r.text
    return int(r.status_code)


def get_raw(server: Server, model: str, key: str) -> torch.Tensor | None:
    with server.http() as c:
        r = c.get(f"/ec/{model}/{DTYPE}/{key}")
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    (tensor,) = safetensors.torch.load(r.content).values()
    return tensor


def delete_raw(server: Server, model: str, key: str) -> None:
    with server.http() as c:
        assert c.delete(f"/ec/{model}/{DTYPE}/{key}").status_code == 204


def embeds(rows: int = 16, width: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g).to(torch.bfloat16)


# The synchronous load path of the tests but test_async_loads.py; the scheduler waits
# for each existence answer.
SYNC = {"load_mode": "sync", "exists_wait_s": 5}


def step(sched: ECCacheConnector, requests: list[Request]) -> tuple[SchedulerOutput, Any]:
    """What vLLM's scheduler does with the connector in one step: ask, allocate the
    items it answered present for (and the computed ones), build the metadata."""
    out = SchedulerOutput.make_empty()
    for req in requests:
        sched.ensure_cache_available(req, req.num_computed_tokens)
        computed = []
        for i, feature in enumerate(req.mm_features):
            if not sched.has_cache_item(feature.identifier):
                computed.append(i)
            sched.update_state_after_alloc(req, i)
        if computed:
            out.scheduled_encoder_inputs[req.request_id] = computed
    meta = sched.build_connector_meta(out)
    out.ec_connector_metadata = meta
    return out, meta


def prefetcher_of(conn: ECCacheConnector) -> Prefetcher:
    """A worker connector's prefetcher (built with its first order)."""
    assert conn.worker is not None and conn.worker.prefetcher is not None
    return conn.worker.prefetcher


def breaker_of(conn: ECCacheConnector) -> CircuitBreaker:
    assert conn.scheduler is not None
    return conn.scheduler.breaker


def tiny_model_config(folder: Path, torch_dtype: str) -> Any:
    """vLLM's ``ModelConfig`` of a one-layer Llama written to ``folder`` (no weights,
    no tokenizer): what the connector reads from a model config, nothing more."""
    from vllm.config import ModelConfig

    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_hidden_layers": 1, "num_key_value_heads": 4, "vocab_size": 1000,
                "max_position_embeddings": 512, "torch_dtype": torch_dtype,
            }
        )
    )  # fmt: skip
    return ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="auto")
