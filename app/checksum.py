"""CRC32C (Castagnoli) helpers over the hardware-accelerated ``crc32c`` package.

``crc32c`` takes any buffer (memoryview, mmap) without copying and releases the GIL;
``google-crc32c`` accepts only ``bytes``, which would force a copy of every mmap.
"""

from __future__ import annotations

import crc32c as _crc32c

from app import wire

if not _crc32c.hardware_based:  # pragma: no cover - depends on the CPU
    import logging

    logging.getLogger(__name__).warning("CRC32C runs in software: no SSE4.2/ARMv8 CRC here")


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


def to_hex(value: int) -> str:
    return f"{value:08x}"


def etag(value: int) -> str:
    """The strong ETag of a body with CRC32C ``value``."""
    return f'"{to_hex(value)}"'


def from_hex(text: str) -> int:
    """Parse exactly 8 lowercase hex digits; raises ``ValueError`` for anything else
    (a sign, ``0x``, underscores, spaces, upper case, non-ASCII digits)."""
    return wire.hex32(text)
