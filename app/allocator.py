"""The C allocator's thresholds, set once at start-up for a server that moves large bodies.

An upload's body reaches the app in pieces of up to 1 MiB (``app.http_protocol``'s read
buffers). glibc serves blocks of that size with a fresh ``mmap`` (the default threshold
is 128 KiB, adjusted upwards only for the largest block freed so far) and hands freed
heap memory back to the kernel once 128 KiB lie free at its top, so every piece of
every body is new memory: one page fault and one zeroed page per 4 KiB. With the mmap threshold at 32 MiB (glibc's maximum on
64-bit) and the trim threshold at 1 GiB, freed pieces are reused instead. Measured with
sequential 4.7 MB PUTs, disk only (``python -m bench.put_cpu``): the server's CPU time
per PUT fell from ~13 ms to ~7 ms, most of it system time spent on page faults.

The cost: memory freed by the process stays mapped (its resident size keeps its
high-water mark, bounded by the upload slots' buffers). An operator who sets glibc's
own ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` keeps those values; other C
libraries (musl) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("app")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 1024 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; False where that is not done."""
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False  # not glibc: its mallopt (if any) means something else
    done = bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    log.debug("glibc malloc thresholds raised: %s", done)
    return done
