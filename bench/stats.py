"""Small statistics helpers shared by the benchmarks, and their target rows."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def target_row(
    name: str, target: float, measured: float, reference: float, higher_is_better: bool = True
) -> dict[str, Any]:
    """One row of a results file's ``targets``: ``measured / reference`` against
    ``target`` (at least, or at most when not ``higher_is_better``)."""
    ratio = measured / reference if reference else math.nan
    ok = ratio >= target if higher_is_better else ratio <= target
    return {
        "target": name,
        "want": f"{'>=' if higher_is_better else '<='} {target:g}x",
        "ratio": ratio,
        "pass": bool(ok),
        "by": ratio - target if higher_is_better else target - ratio,
    }
