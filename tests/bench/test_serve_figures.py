"""bench/serve.py's arithmetic and rendering: medians and ranges per row, each change as
the range of the per-pass ratios to the baseline's pass of the same seed, "within noise"
when that range includes zero, and README.md's block replaced in place."""

from __future__ import annotations

from typing import Any

import pytest

from bench import serve


def _passes(requests_per_s: list[float], ttft_ms: list[float]) -> list[dict[str, Any]]:
    return [
        {
            "seed": 1234 + i,
            **dict.fromkeys(serve.FIGURES, 1.0),
            "requests_per_s": rate,
            "ttft_p50_ms": ttft,
        }
        for i, (rate, ttft) in enumerate(zip(requests_per_s, ttft_ms, strict=True))
    ]


def _row(name: str, rates: list[float], ttfts: list[float]) -> dict[str, Any]:
    return {
        "row": name,
        "completed": 10,
        "failed": 0,
        "passes": _passes(rates, ttfts),
        "connector": {},
        "server": {},
    }


def test_changes_are_paired_per_pass_with_their_range() -> None:
    rows = serve.summarize(
        [
            _row("none", [4.0, 5.0, 6.0], [100, 200, 300]),
            _row("none, again", [4.4, 4.5, 6.6], [100, 180, 330]),
            # The same pass-to-pass drift as the baseline: a steady +50% in each pass,
            # although the medians' ranges overlap.
            _row("other node", [6.0, 7.5, 9.0], [50, 100, 150]),
            _row("warm", [8.8, 9.0, 13.2], [50, 90, 165]),
        ]
    )
    none, again, other, warm = rows
    assert "versus" not in none
    assert none["requests_per_s"] == 5.0 and none["spread"]["requests_per_s"] == [4.0, 6.0]
    rate = other["versus"]["requests_per_s"]
    assert rate["passes"] == pytest.approx([0.5, 0.5, 0.5])
    assert (rate["median"], rate["min"], rate["max"]) == pytest.approx((0.5, 0.5, 0.5))
    assert rate["within_noise"] is False
    assert other["versus"]["ttft_p50_ms"]["median"] == pytest.approx(-0.5)
    # none, again against none: +10%, -10%, +10%: a range across zero.
    noisy = again["versus"]["requests_per_s"]
    assert noisy["within_noise"] is True
    assert (noisy["min"], noisy["median"], noisy["max"]) == pytest.approx((-0.1, 0.1, 0.1))
    assert serve.change(noisy) == "within noise (-10%..+10%)"
    assert serve.change(rate) == "+50% (+50%..+50%)"
    # warm compares with none, again (vLLM's own caches help both), pass by pass.
    assert warm["versus"]["baseline"] == "none, again"
    assert warm["versus"]["requests_per_s"]["passes"] == pytest.approx([1.0, 1.0, 1.0])


def test_summarize_is_idempotent() -> None:
    rows = [_row("none", [4.0, 5.0], [1, 2]), _row("cold", [3.0, 4.5], [2, 2])]
    once = serve.summarize(rows)
    assert serve.summarize(once) == once


def test_readme_block_is_replaced_in_place() -> None:
    text = f"intro\n{serve.README_BEGIN}\nold table\n{serve.README_END}\nafter\n"
    block = f"{serve.README_BEGIN}\nnew table\n{serve.README_END}\n"
    assert serve.readme_with(text, block) == f"intro\n{block}after\n"


def test_a_second_run_is_checked_against_the_first_runs_spread() -> None:
    def run(commit: str, rates: list[float], ttfts: list[float]) -> dict[str, Any]:
        meta = {"commit": commit * 40, "started": "2026-12-07 20:00:00 +0000"}
        return {"meta": meta, "rows": serve.summarize([_row("none", rates, ttfts)])}

    first = run("a", [4.0, 5.0, 6.0], [100, 200, 300])
    inside = run("b", [5.5, 5.9, 6.2], [150, 250, 260])
    outside = run("c", [6.1, 6.5, 7.0], [150, 250, 260])
    assert serve.reproduction(first, inside).splitlines()[-1].endswith("| yes |")
    assert serve.reproduction(first, outside).splitlines()[-1].endswith("| no |")
