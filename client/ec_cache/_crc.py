"""Incremental CRC32C (Castagnoli) over any buffer, without copying it.

Uses the hardware-accelerated ``crc32c`` package, which reads memoryviews of tensors
and receive buffers in place and releases the GIL on large inputs (``google-crc32c``
accepts only ``bytes`` and would force a copy of every chunk).
"""

from __future__ import annotations

import crc32c as _crc32c

__all__ = ["Crc32c", "crc32c"]

Buffer = bytes | bytearray | memoryview


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value``.

    >>> f"{crc32c(b'123456789'):08x}"
    'e3069283'
    """
    return int(_crc32c.crc32c(data, value))


class Crc32c:
    """Incremental CRC32C.

    >>> c = Crc32c(); c.update(b"1234"); c.update(bytearray(b"56789")); c.hexdigest()
    'e3069283'
    """

    __slots__ = ("value",)

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def update(self, data: Buffer) -> None:
        self.value = int(_crc32c.crc32c(data, self.value))

    def hexdigest(self) -> str:
        return f"{self.value:08x}"
