"""Building safetensors bodies for tests without the SDK."""

from __future__ import annotations

import json
import struct

import crc32c
import numpy as np


def body(
    shape: tuple[int, ...] = (4, 8),
    code: str = "F32",
    itemsize: int = 4,
    *,
    seed: int = 0,
    header: dict[str, object] | None = None,
) -> bytes:
    """A single-tensor safetensors body with random data."""
    nbytes = int(np.prod(shape)) * itemsize
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    meta = header or {"t": {"dtype": code, "shape": list(shape), "data_offsets": [0, nbytes]}}
    raw = json.dumps(meta).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def crc_hex(data: bytes) -> str:
    return f"{crc32c.crc32c(data):08x}"
