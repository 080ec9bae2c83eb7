"""The connector's settings: ``ec_connector_extra_config`` parsed by one typed model,
and the namespace (model, dtype) they and vLLM's configuration resolve to.

Unknown keys are refused (a typo never silently becomes a default). Sizes use the
server's grammar (``EC_*`` settings): bytes, or a binary K/M/G/T suffix with optional
``i`` and ``B`` (``512M``, ``512MB`` and ``512MiB`` are all 512 * 2**20 bytes).
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

import ec_cache
from ec_cache._keys import model_error, segment_ok

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# re.ASCII, as the server's: \d and int() would take any Unicode digit.
_SIZE = re.compile(r"\s*([0-9]+)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE | re.ASCII)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: Any) -> Any:
    """``1048576``, ``"512KiB"``, ``"10G"`` -> bytes; anything else is left to pydantic."""
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match is None:
            raise ValueError(f"{value!r} is not a size: use bytes or a KiB/MiB/GiB/TiB suffix")
        number, unit = match.groups()
        return int(number) * _SIZE_UNITS[(unit or "").upper()[:1]]
    return value


def _check_revision(value: str) -> str:
    if not segment_ok(value):
        raise ValueError(f"{value!r} is not one model segment: letters, digits, . _ - @ +")
    return value


ByteSize = Annotated[int, BeforeValidator(parse_size), Field(ge=1)]
Seconds = Annotated[float, Field(ge=0)]
Timeout = Annotated[float, Field(ge=0.001)]
Count = Annotated[int, Field(ge=1)]


def check_model_namespace(model: str) -> str:
    """``model`` if it is a valid ``{model}`` path part (docs/http-api.md), else
    ``ValueError`` naming the rule."""
    if model_error(model) is not None:
        raise ValueError(
            f"{model!r} is not a valid ec-cache model namespace: use '/'-separated segments "
            "of letters, digits, '.', '_', '-', '@', '+' (no empty, '.' or '..' segment, "
            "at most 256 bytes)"
        )
    return model


class ECCacheConnectorConfig(BaseModel):
    """The connector's settings; build it with :meth:`from_extra_config`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    urls: tuple[str, ...] = Field(min_length=1)
    model: str | None = None
    encoder_revision: Annotated[str, AfterValidator(_check_revision)] | None = None
    dtype: str | None = None
    token: str | None = None
    # scheduler
    exists_timeout_s: Timeout = 0.1
    exists_wait_s: Seconds = 0.002
    hit_cache_size: Annotated[int, Field(ge=0)] = 65536
    hit_ttl_s: Seconds | None = 300.0
    miss_ttl_s: Seconds = 1.0
    breaker_failures: Count = 3
    breaker_cooldown_s: Seconds = 1.0
    breaker_max_cooldown_s: Seconds = 30.0
    # scheduler: claims (encode once per cluster; asynchronous loads only)
    claims: bool = True
    claim_lease_s: Timeout = 10.0
    claim_wait_s: Seconds = 10.0
    claim_timeout_s: Timeout = 1.0
    # worker: load
    load_mode: Literal["async", "sync"] = "async"
    load_timeout_s: Timeout = 10.0
    load_min_bytes_per_s: Annotated[int, BeforeValidator(parse_size), Field(ge=0)] = 1 << 20
    load_concurrency: Count = 8
    prefetch_buffer_bytes: ByteSize = 1 << 30
    on_load_failure: Literal["recompute", "raise"] = "recompute"
    device: str | None = None
    # worker: save
    save: bool | None = None
    save_all_ranks: bool = False
    save_queue_items: Count = 64
    save_queue_bytes: ByteSize = 1 << 30
    upload_threads: Count = 2
    upload_timeout_s: Timeout = 30.0
    log_interval_s: Seconds = 60.0

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ECCacheConnectorConfig:
        """Parse ``ec_connector_extra_config``; ``ValueError`` naming each bad key.

        ``url`` (or ``urls``): one URL, a comma-separated list or a JSON list, else
        ``$EC_CACHE_URL``; ``token`` defaults to ``$EC_CACHE_TOKEN``; an empty string
        for an optional text key means "not set".
        """
        known = {"url", *cls.model_fields}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"ec_connector_extra_config: unknown key(s) {unknown} for ECCacheConnector; "
                f"known: {sorted(known)}"
            )
        if "url" in extra and "urls" in extra:
            raise ValueError("ec_connector_extra_config: give 'url' or 'urls', not both")
        data = {k: v for k, v in extra.items() if k != "url"}
        raw_urls = extra.get("urls", extra.get("url")) or os.environ.get("EC_CACHE_URL")
        if not raw_urls:
            raise ValueError(
                "ECCacheConnector needs the server: set ec_connector_extra_config.url "
                "(a URL, a comma-separated list or a JSON list) or EC_CACHE_URL"
            )
        parts = raw_urls.split(",") if isinstance(raw_urls, str) else raw_urls
        data["urls"] = tuple(u.strip() for u in parts if isinstance(u, str) and u.strip())
        for key in ("model", "encoder_revision", "dtype", "token", "device"):
            if data.get(key) == "":
                data[key] = None
        if data.get("token") is None:
            data["token"] = os.environ.get("EC_CACHE_TOKEN") or None
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg']}"
                for err in exc.errors()
            )
            raise ValueError(f"ec_connector_extra_config: {problems}") from None


def resolve_namespace(cfg: ECCacheConnectorConfig, vllm_config: VllmConfig) -> tuple[str, str]:
    """The ``(model, dtype)`` path parts for this deployment.

    ``model``: the extra config's ``model`` if set, else the model config's ``model``
    (a Hugging Face id such as ``Qwen/Qwen2.5-VL-7B-Instruct``), else its served
    name; plus ``@{encoder_revision}`` when set. A local path (``/models/x``) is not a
    namespace: set ``model`` then. ``dtype``: the extra config's ``dtype`` if set,
    else the model config's dtype.
    """
    model_config = getattr(vllm_config, "model_config", None)
    model = cfg.model
    if model is None and model_config is not None:
        candidates = [getattr(model_config, "model", None)]
        served = getattr(model_config, "served_model_name", None)
        candidates += served if isinstance(served, list) else [served]
        for candidate in candidates:
            if isinstance(candidate, str):
                try:
                    model = check_model_namespace(candidate)
                    break
                except ValueError:
                    continue
        if model is None:
            raise ValueError(
                f"ECCacheConnector: the model {getattr(model_config, 'model', None)!r} is "
                "not usable as an ec-cache namespace (a local path?); set "
                "ec_connector_extra_config.model, e.g. 'Qwen/Qwen2.5-VL-7B-Instruct'"
            )
    if model is None:
        raise ValueError("ECCacheConnector: no model config; set ec_connector_extra_config.model")
    if cfg.encoder_revision:
        model = f"{model}@{cfg.encoder_revision}"
    check_model_namespace(model)

    dtype = cfg.dtype
    if dtype is None:
        model_dtype = getattr(model_config, "dtype", None) if model_config else None
        if isinstance(model_dtype, torch.dtype):
            dtype = str(model_dtype).removeprefix("torch.")
        elif isinstance(model_dtype, str) and model_dtype not in ("auto", ""):
            dtype = model_dtype.removeprefix("torch.")
        else:
            raise ValueError(
                "ECCacheConnector: the model's dtype is unknown; set "
                "ec_connector_extra_config.dtype (e.g. 'bfloat16')"
            )
    return model, dtype


def make_client(
    cfg: ECCacheConnectorConfig,
    model: str,
    dtype: str,
    *,
    timeout: float,
    attempts: int,
    raise_on_unavailable: bool,
    concurrency: int,
) -> ec_cache.Client:
    """A blocking client of the configured replicas for one of the connector's uses."""
    return ec_cache.Client(
        list(cfg.urls),
        model=model,
        dtype=dtype,
        token=cfg.token,
        timeouts=ec_cache.Timeouts.of(timeout),
        retries=ec_cache.Retries(attempts=attempts, backoff=min(0.05, timeout / 4)),
        limits=ec_cache.Limits(concurrency=concurrency),
        raise_on_unavailable=raise_on_unavailable,
    )
