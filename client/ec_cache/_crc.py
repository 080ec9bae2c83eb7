"""CRC32C (Castagnoli) over any buffer without copying it.

``google_crc32c.extend`` only accepts ``bytes`` (its C entry point parses ``y#``), which
would force a copy of every received chunk. The wheel ships the hardware-accelerated
``crc32c`` library itself; when it can be found it is called through ``ctypes`` on the
buffer's address (which also releases the GIL). Otherwise the public function is used
on a ``bytes`` copy.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Callable

import google_crc32c

__all__ = ["Crc32c", "crc32c", "native"]

Buffer = bytes | bytearray | memoryview


def _load_native() -> Callable[[int, int, int], int] | None:
    base = os.path.dirname(os.path.dirname(os.path.abspath(google_crc32c.__file__)))
    candidates = sorted(glob.glob(os.path.join(base, "google_crc32c.libs", "libcrc32c*")))
    candidates += sorted(
        glob.glob(os.path.join(os.path.dirname(google_crc32c.__file__), "libcrc32c*"))
    )
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            fn = lib.crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        if fn(0, ctypes.cast(ctypes.c_char_p(b"123456789"), ctypes.c_void_p), 9) == 0xE3069283:
            return fn
    return None


_native = _load_native()
native = _native is not None
"""Whether the zero-copy (``ctypes``) path is in use."""


def _extend(value: int, data: Buffer) -> int:
    n = len(data) if not isinstance(data, memoryview) else data.nbytes
    if n == 0:
        return value
    if isinstance(data, bytes):
        return int(google_crc32c.extend(value, data))
    if _native is not None:
        mv = data if isinstance(data, memoryview) else memoryview(data)
        if not mv.readonly and mv.c_contiguous:
            holder = (ctypes.c_char * n).from_buffer(mv)
            try:
                return _native(value, ctypes.addressof(holder), n)
            finally:
                del holder
    return int(google_crc32c.extend(value, bytes(data)))


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value``.

    >>> f"{crc32c(b'123456789'):08x}"
    'e3069283'
    """
    return _extend(value, data)


class Crc32c:
    """Incremental CRC32C.

    >>> c = Crc32c(); c.update(b"1234"); c.update(bytearray(b"56789")); c.hexdigest()
    'e3069283'
    """

    __slots__ = ("value",)

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def update(self, data: Buffer) -> None:
        self.value = _extend(self.value, data)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"
