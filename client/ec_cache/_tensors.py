"""Dtypes, keys, and the single-tensor safetensors format.

The body of every PUT and GET is a safetensors file holding exactly one tensor::

    u64 little-endian N | N bytes of JSON header (space padded) | raw C-order data

The SDK builds the header itself and sends it followed by the tensor's own memory, and
reads the data of a GET straight into the destination's memory; nothing here copies
tensor data. Importing this module does not import torch (the CLI's commands that move
no tensor start without it): the functions that handle a tensor import it.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._exceptions import IntegrityError, InvalidKeyError, InvalidTensorError
from ._keys import DTYPE_NAMES, hash_error, hashes_error, model_error

__all__ = [
    "CODES",
    "DTYPES",
    "EntryInfo",
    "TensorMeta",
    "build_header",
    "dtype_name",
    "parse_dtype",
    "parse_header",
    "parse_header_length",
    "tensor_memoryview",
    "torch_dtype",
]

TENSOR_NAME = "tensor"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself applies
MAX_DIMS = 64
MAX_DIM = 2**63 - 1  # torch sizes are int64

# wire name -> (safetensors dtype code, bytes per element), in the order of
# _keys.DTYPE_NAMES; torch's dtype of each name is ``getattr(torch, name)``.
CODES: dict[str, tuple[str, int]] = {
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float64": ("F64", 8),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "int16": ("I16", 2),
    "int32": ("I32", 4),
    "int64": ("I64", 8),
    "bool": ("BOOL", 1),
}
assert tuple(CODES) == DTYPE_NAMES  # one list of names (ec_cache._keys)
_BY_CODE = {code: name for name, (code, _) in CODES.items()}

if TYPE_CHECKING:
    import torch

    #: wire name -> (torch dtype, safetensors dtype code); built on first use
    DTYPES: dict[str, tuple[torch.dtype, str]]


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` of a wire name (imports torch).

    >>> torch_dtype("bfloat16")
    torch.bfloat16
    """
    import torch

    if name not in CODES:
        raise KeyError(f"dtype {name!r} is not stored by ec-cache")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # the torch dtypes, without importing torch with this module
        table = {wire: (torch_dtype(wire), code) for wire, (code, _) in CODES.items()}
        globals()["DTYPES"] = table
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_dtype(dtype: torch.dtype | str) -> str:
    """The wire name of ``dtype`` (a ``torch.dtype``, ``"bfloat16"`` or
    ``"torch.bfloat16"``); raises ``InvalidKeyError`` for anything ec-cache does not
    store.

    >>> parse_dtype(torch.bfloat16), parse_dtype("torch.float8_e4m3fn")
    ('bfloat16', 'float8_e4m3fn')
    """
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in CODES:
            return name
    elif "torch" in sys.modules:  # a torch.dtype can only come from an imported torch
        import torch

        if isinstance(dtype, torch.dtype):
            name = str(dtype).removeprefix("torch.")
            if name not in CODES:
                raise InvalidKeyError(f"dtype {dtype} is not stored by ec-cache")
            return name
    raise InvalidKeyError(f"dtype {dtype!r} is not one of {', '.join(CODES)}")


def dtype_name(dtype: torch.dtype) -> str:
    return parse_dtype(dtype)


def check_model(model: str) -> str:
    """Validate a model name (``/``-separated segments); returns it unchanged."""
    error = model_error(model)
    if error is not None:
        raise InvalidKeyError(error)
    return model


def check_hash(value: str) -> str:
    error = hash_error(value)
    if error is not None:
        raise InvalidKeyError(error)
    return value


def check_hashes(values: Iterable[str]) -> list[str]:
    """``values`` as a list, each checked as by :func:`check_hash`."""
    hashes = list(values)
    error = hashes_error(hashes)
    if error is not None:
        raise InvalidKeyError(error)
    return hashes


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a single-tensor safetensors header describes."""

    dtype: str
    shape: tuple[int, ...]
    header_length: int  # N, the JSON length

    @property
    def data_offset(self) -> int:
        return 8 + self.header_length

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * CODES[self.dtype][1]

    @property
    def total(self) -> int:
        return self.data_offset + self.nbytes


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """What ``HEAD`` says about an entry (``Client.head``)."""

    hash: str
    dtype: str
    shape: tuple[int, ...]
    size: int
    """Bytes of the whole safetensors body."""
    crc32c: str | None
    tier: str | None
    """Which tier answered: ``"disk"`` or ``"s3"``."""
    url: str
    """The replica that answered."""

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return math.prod(self.shape) * CODES[self.dtype][1]


def build_header(dtype: str, shape: tuple[int, ...] | list[int]) -> bytes:
    """The first ``8 + N`` bytes of the body: length prefix and JSON header, padded
    with spaces so that the data starts 8-byte aligned (as safetensors writes it).

    >>> h = build_header("bfloat16", (2, 3)); len(h) % 8, h[8:].rstrip()
    (0, b'{"tensor":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}}')
    """
    code, itemsize = CODES[dtype]
    nbytes = math.prod(shape) * itemsize
    text = json.dumps(
        {
            TENSOR_NAME: {
                "dtype": code,
                "shape": [int(d) for d in shape],
                "data_offsets": [0, nbytes],
            }
        },
        separators=(",", ":"),
    ).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


def parse_header_length(prefix: bytes | bytearray | memoryview, total: int | None) -> int:
    """N from the 8-byte prefix, checked against the body length."""
    if len(prefix) != 8:
        raise IntegrityError("body shorter than the 8-byte safetensors prefix")
    (n,) = struct.unpack("<Q", prefix)
    limit = MAX_HEADER_BYTES if total is None else min(MAX_HEADER_BYTES, total - 8)
    if n < 2 or n > limit:
        raise IntegrityError(f"safetensors header length {n} is not plausible")
    return int(n)


def parse_header(header: bytes | bytearray | memoryview, *, total: int | None = None) -> TensorMeta:
    """Parse and check a single-tensor safetensors JSON header.

    ``total`` (the body length, when known) must equal ``8 + N + nbytes``.
    Raises ``IntegrityError`` for anything else than exactly one dense tensor.
    """
    try:
        data: Any = json.loads(bytes(header))
    except (ValueError, RecursionError) as exc:  # also int()'s digit limit, deep nesting
        raise IntegrityError(f"safetensors header is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise IntegrityError("safetensors header is not a JSON object")
    entries = {k: v for k, v in data.items() if k != "__metadata__"}
    if len(entries) != 1:
        raise IntegrityError(f"body holds {len(entries)} tensors, expected exactly one")
    (entry,) = entries.values()
    if not isinstance(entry, dict):
        raise IntegrityError("safetensors tensor entry is not an object")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(code, str) or code not in _BY_CODE:
        raise IntegrityError(f"safetensors dtype {code!r:.80} is not stored by ec-cache")
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_DIMS
        and all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)
    ):
        raise IntegrityError(f"safetensors shape {str(shape)[:200]} is not a list of sizes")
    meta = TensorMeta(_BY_CODE[code], tuple(shape), len(header))
    # torch sizes tensors in signed 64-bit, even with no elements (zero dims count as 1).
    itemsize = CODES[meta.dtype][1]
    if math.prod(max(d, 1) for d in shape) * itemsize >= 1 << 63:
        raise IntegrityError(f"safetensors shape {shape!r:.80} is too large for a tensor")
    if not (isinstance(offsets, list) and all(type(o) is int for o in offsets)):
        raise IntegrityError(f"safetensors data_offsets {offsets!r:.80} are not integers")
    if offsets != [0, meta.nbytes]:
        raise IntegrityError(
            f"safetensors data_offsets {offsets!r} do not match shape {shape} ({meta.nbytes} B)"
        )
    if total is not None and meta.total != total:
        raise IntegrityError(f"body is {total} bytes but its header describes {meta.total}")
    return meta


_DIM_RE = re.compile(r"[0-9]{1,19}")


def parse_shape(text: str) -> tuple[int, ...]:
    """``X-EC-Shape`` (``"576,4096"``; empty for a scalar); ``ValueError`` unless every
    part is plain decimal digits (no sign, ``_``, spaces or non-ASCII digits).

    >>> parse_shape("576,4096"), parse_shape("")
    ((576, 4096), ())
    """
    text = text.strip()
    if not text:
        return ()
    parts = text.split(",")
    if len(parts) > MAX_DIMS or not all(_DIM_RE.fullmatch(p) for p in parts):
        raise ValueError(f"bad shape {text[:80]!r}")
    return tuple(int(part) for part in parts)


def tensor_memoryview(tensor: torch.Tensor) -> memoryview:
    """A writable ``memoryview`` (format ``B``) over a contiguous CPU tensor's bytes.

    No copy is made and numpy is not needed. The view keeps ``tensor`` alive.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise InvalidTensorError("tensor_memoryview needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    array._ec_keepalive = tensor  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


def check_tensor(tensor: object, dtype: str) -> torch.Tensor:
    """Accept ``tensor`` for a PUT of ``dtype`` or raise ``InvalidTensorError``."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise InvalidTensorError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise InvalidTensorError(f"only dense tensors can be stored, not {tensor.layout}")
    if tensor.device.type == "meta":
        raise InvalidTensorError("a meta tensor has no data to store")
    if tensor.dtype != torch_dtype(dtype):
        raise InvalidTensorError(
            f"tensor dtype {tensor.dtype} does not match the client's dtype {dtype}"
        )
    if sys.byteorder != "little":  # pragma: no cover - no big-endian torch targets
        raise InvalidTensorError("ec-cache bodies are little-endian; this host is not")
    return tensor
