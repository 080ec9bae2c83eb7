"""ec-cache SDK: store and load multimodal encoder outputs (tensors) in a shared cache.

>>> import torch, ec_cache
>>> cache = ec_cache.Client("http://127.0.0.1:8080", model="llava-hf/llava-1.5-7b-hf",
...                         dtype="bfloat16")                         # doctest: +SKIP
>>> cache.put("0f3a...", torch.zeros(576, 4096, dtype=torch.bfloat16))  # doctest: +SKIP
True
>>> cache.get("0f3a...", device="cuda:0").shape                      # doctest: +SKIP
torch.Size([576, 4096])

:class:`AsyncClient` has the same methods as coroutines. Misses are ``None``; every
error is an :class:`ECCacheError` (see :mod:`ec_cache._exceptions` for the tree).
Importing the package does not import torch; the calls that take or return a tensor do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from ._async.client import AsyncClient
from ._buffers import BufferPool
from ._claims import KeyStatus
from ._config import Limits, Retries, Timeouts
from ._exceptions import (
    ConnectError,
    ECCacheError,
    IntegrityError,
    InvalidKeyError,
    InvalidTensorError,
    ServerError,
    TransportError,
    TransportTimeout,
    UnavailableError,
)
from ._sync.client import Client
from ._tensors import EntryInfo

if TYPE_CHECKING:
    from ._tensors import DTYPES

__all__ = [
    "DTYPES",
    "AsyncClient",
    "BufferPool",
    "Client",
    "ConnectError",
    "ECCacheError",
    "EntryInfo",
    "IntegrityError",
    "InvalidKeyError",
    "InvalidTensorError",
    "KeyStatus",
    "Limits",
    "Retries",
    "ServerError",
    "Timeouts",
    "TransportError",
    "TransportTimeout",
    "UnavailableError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # imports torch: on first use, not with the package
        from . import _tensors

        return _tensors.DTYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
