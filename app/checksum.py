"""CRC32C (Castagnoli) helpers over the hardware-accelerated ``google-crc32c``."""

from __future__ import annotations

import base64

import google_crc32c

if google_crc32c.implementation != "c":  # pragma: no cover - depends on the wheel
    raise ImportError("google-crc32c has no C extension here; the pure-Python one is too slow")


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value``."""
    return int(google_crc32c.extend(value, data))


def to_hex(value: int) -> str:
    return f"{value:08x}"


def from_hex(text: str) -> int:
    """Parse 8 hex digits; raises ``ValueError`` for anything else."""
    if len(text) != 8:
        raise ValueError("a CRC32C is 8 hex digits")
    return int(text, 16)


def to_base64(value: int) -> str:
    """The form S3 uses in ``x-amz-checksum-crc32c``: base64 of the big-endian bytes."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def from_base64(text: str) -> int:
    return int.from_bytes(base64.b64decode(text), "big")
