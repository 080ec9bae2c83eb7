"""The few vLLM objects ``ec_cache.vllm`` needs, for machines without vLLM.

The GPU benchmark (``bench/gpu.py``) drives the connector's save path
(``ECCacheConnector.save_caches``: side-stream staging copy, background upload) on a
machine whose image has no vLLM (the H200) and in its CPU mode here. The connector
imports only ``ECConnectorBase``/``ECConnectorMetadata``/``ECConnectorRole`` and
``ECConnectorPromMetrics``/``ECConnectorStats`` at module level, and reads a handful of
attributes of the ``VllmConfig``; :func:`install` registers stand-ins for exactly those
(the base class as vLLM 0.33.0 defines it: role, producer/consumer flags, connector
metadata binding) when vLLM itself cannot be imported, and :func:`vllm_config` builds a
config object with the attributes the connector reads.

Nothing here is used by the SDK or its tests; ``tests/vllm`` runs against vLLM itself.
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from typing import Any

__all__ = ["install", "vllm_config"]

_MODULES = (
    "vllm",
    "vllm.distributed",
    "vllm.distributed.ec_transfer",
    "vllm.distributed.ec_transfer.ec_connector",
    "vllm.distributed.ec_transfer.ec_connector.base",
    "vllm.distributed.ec_transfer.ec_connector.metrics",
)


class ECConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class ECConnectorMetadata:
    """Scheduler -> worker metadata (an empty base in vLLM too)."""


class ECConnectorBase:
    """What ``ECCacheConnector`` uses of vLLM's base class."""

    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        self._connector_metadata: ECConnectorMetadata | None = None
        self._vllm_config = vllm_config
        self._role = role
        ec = vllm_config.ec_transfer_config
        if ec is None:
            raise ValueError("ec_transfer_config must be set for ECConnectorBase")
        self._is_producer = bool(ec.is_ec_producer)
        self._is_consumer = bool(ec.is_ec_consumer)

    @property
    def role(self) -> ECConnectorRole:
        return self._role

    @property
    def is_producer(self) -> bool:
        return self._is_producer

    @property
    def is_consumer(self) -> bool:
        return self._is_consumer

    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def shutdown(self) -> None:
        return None


@dataclass
class ECConnectorStats:
    data: dict[str, Any] = field(default_factory=dict)


class ECConnectorPromMetrics:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._counter_cls: Any = None


@dataclass
class _ECTransferConfig:
    ec_connector_extra_config: dict[str, Any]
    ec_role: str = "ec_both"
    ec_connector: str = "ECCacheConnector"
    ec_connector_module_path: str = "ec_cache.vllm"

    @property
    def is_ec_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_ec_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")


def vllm_config(extra: dict[str, Any], *, model: str, dtype: str, ec_role: str = "ec_both") -> Any:
    """A ``VllmConfig`` stand-in: ``ec_transfer_config``, ``model_config`` and
    ``parallel_config`` (tensor-parallel size 1) with the fields the connector reads."""
    return types.SimpleNamespace(
        ec_transfer_config=_ECTransferConfig(dict(extra), ec_role=ec_role),
        model_config=types.SimpleNamespace(model=model, served_model_name=None, dtype=dtype),
        parallel_config=types.SimpleNamespace(
            tensor_parallel_size=1, prefill_context_parallel_size=1
        ),
    )


def install() -> bool:
    """Register the stand-in modules unless vLLM is importable; ``True`` when the
    stand-ins are in use."""
    if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is not None:
        return False
    if isinstance(sys.modules.get("vllm"), types.ModuleType) and not getattr(
        sys.modules["vllm"], "_ec_cache_shim", False
    ):
        return False
    for name in _MODULES:
        module = sys.modules.get(name) or types.ModuleType(name)
        module._ec_cache_shim = True  # type: ignore[attr-defined]
        sys.modules[name] = module
    base = sys.modules["vllm.distributed.ec_transfer.ec_connector.base"]
    base.ECConnectorBase = ECConnectorBase  # type: ignore[attr-defined]
    base.ECConnectorMetadata = ECConnectorMetadata  # type: ignore[attr-defined]
    base.ECConnectorRole = ECConnectorRole  # type: ignore[attr-defined]
    metrics = sys.modules["vllm.distributed.ec_transfer.ec_connector.metrics"]
    metrics.ECConnectorStats = ECConnectorStats  # type: ignore[attr-defined]
    metrics.ECConnectorPromMetrics = ECConnectorPromMetrics  # type: ignore[attr-defined]
    return True
