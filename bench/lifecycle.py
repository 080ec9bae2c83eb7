"""SIGTERM unwinds a benchmark like Ctrl-C: every server it started is stopped by its
context manager and its temp folder removed, instead of being left running."""

from __future__ import annotations

import signal
from types import FrameType


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def unwind_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
