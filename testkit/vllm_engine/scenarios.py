"""Stall scenarios for a real engine (``engine_run``'s ``scenarios`` mode), shared by
tests/vllm_engine/test_async_loads.py and bench/vllm_stalls.py.

In each one a long text request decodes in the background while image requests
arrive; a fault proxy between the connector and the server holds their entry GETs
or ``_exists`` questions back, or breaks the GETs. What matters is whether the text
request keeps its pace (its inter-token gaps) and how long ``Scheduler.schedule``
takes, while the image requests wait.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

HOLD_S = 3.0  # an entry GET held back this long
EXISTS_HOLD_S = 0.1  # an _exists question held back this long
LOAD_TIMEOUT_S = 4.0  # the connector's load_timeout_s in these runs (> HOLD_S)
MAX_MODEL_LEN = 8192  # room for the background request's tokens
# The background request decodes until the scenario ends (then it is aborted): at
# 2 ms a token (a fast CI machine), 8,000 tokens outlast the longest scenario.
TEXT_TOKENS = 8000


def _text() -> dict[str, Any]:
    return {
        "id": "text",
        "text": "Tell a long story.",
        "images": [],
        "max_tokens": TEXT_TOKENS,
        "ignore_eos": True,
    }


def _image(name: str, seed: int, after_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "id": name,
        "text": "Describe.",
        "images": [seed],
        "max_tokens": 8,
        "after": {"request": "text", "tokens": after_tokens},
        **extra,
    }


def _scenario(
    name: str, proxy: dict[str, Any], *images: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    settings = {"mode": "pass", "delay_s": 0.0, "exists_delay_s": 0.0, **proxy}
    return {
        "name": name,
        "proxy": settings,
        "background": "text",
        "requests": [_text(), *images],
        **extra,
    }


HOLD = _scenario("hold", {"mode": "slow", "delay_s": HOLD_S}, _image("image", 21, 20))
EXISTS_HOLD = _scenario(
    "exists-hold",
    {"exists_delay_s": EXISTS_HOLD_S},
    _image("image-a", 31, 10),
    _image("image-b", 32, 60),
    _image("image-c", 33, 110),
)
FAILURES = {
    mode: _scenario(f"fail-{mode}", {"mode": proxy_mode, "delay_s": 30}, _image("image", seed, 10))
    for mode, proxy_mode, seed in (
        ("503", "503", 41),
        ("reset", "reset", 42),
        ("corrupt", "corrupt", 43),
        ("timeout", "slow", 44),
    )
}
ABORT = _scenario(
    "abort",
    {"mode": "slow", "delay_s": 2.0},
    _image("image", 51, 10, abort_after_s=0.3),
    settle_s=2.5,  # the held GET is abandoned on release, its bytes freed with it,
    settle_on=["worker", "prefetch_dropped"],  # and the scheduler told of it
)
ALL = [HOLD, EXISTS_HOLD, *FAILURES.values(), ABORT]
IMAGE_SEEDS = sorted(
    {seed for scenario in ALL for request in scenario["requests"] for seed in request["images"]}
)


def by_name(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {scenario["name"]: scenario for scenario in run["scenarios"]}


def waited(scenario: dict[str, Any], request: str) -> tuple[float, float]:
    """When ``request`` arrived and when its first token came (scenario seconds)."""
    record = scenario["requests"][request]
    return record["added_at"], record["token_times"][0]


def max_gap(scenario: dict[str, Any], start: float, end: float) -> float:
    """The text request's longest inter-token gap overlapping ``[start, end]``."""
    times: list[float] = scenario["requests"]["text"]["token_times"]
    gaps = [b - a for a, b in itertools.pairwise(times) if b > start and a < end]
    assert gaps, "the text request did not decode during the window"
    return max(gaps)


def median_gap(scenario: dict[str, Any]) -> float:
    times: list[float] = scenario["requests"]["text"]["token_times"]
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def delta(scenario: dict[str, Any], role: str) -> dict[str, float]:
    """Counters of ``role`` (scheduler or worker) added during the scenario."""
    before, after = scenario["counters_before"][role], scenario["counters_after"][role]
    added = {name: value - before.get(name, 0) for name, value in after.items()}
    return {name: value for name, value in added.items() if value}


def figures(run: dict[str, Any]) -> dict[str, float]:
    """The stall figures of a run: the text request's longest gap while an entry GET
    is held ``HOLD_S``; ``Scheduler.schedule`` times and the longest gap while each
    new image request's ``_exists`` is held ``EXISTS_HOLD_S``."""
    scenarios = by_name(run)
    out: dict[str, float] = {}
    hold = scenarios.get("hold")
    if hold is not None:
        out["hold_max_gap_s"] = max_gap(hold, *waited(hold, "image"))
        out["hold_median_gap_s"] = median_gap(hold)
        start, end = waited(hold, "image")
        out["hold_image_wait_s"] = end - start
    exists = scenarios.get("exists-hold")
    if exists is not None:
        steps = exists["schedule_seconds"]
        out["exists_schedule_max_s"] = max(steps)
        out["exists_schedule_p50_s"] = statistics.median(steps)
        out["exists_schedule_p99_s"] = statistics.quantiles(steps, n=100)[98]
        start = exists["requests"]["image-a"]["added_at"]
        end = max(r["token_times"][0] for n, r in exists["requests"].items() if n != "text")
        out["exists_max_gap_s"] = max_gap(exists, start, end)
    return out
