"""bench/serve.py's arithmetic and rendering: medians and ranges per row, each change as
the range of the per-pass ratios to the baseline's pass of the same seed, "within noise"
when that range includes zero, and README.md's block replaced in place."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from bench import provenance, serve


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
    assert (rate["median"], *rate["interval"]) == pytest.approx((0.5, 0.5, 0.5))
    assert rate["within_noise"] is False
    assert other["versus"]["ttft_p50_ms"]["median"] == pytest.approx(-0.5)
    # none, again against none: +10%, -10%, +10%: a range across zero.
    noisy = again["versus"]["requests_per_s"]
    assert noisy["within_noise"] is True
    assert (noisy["median"], *noisy["interval"]) == pytest.approx((0.1, -0.1, 0.1))
    assert serve.change(noisy) == "within noise (-10%..+10%)"
    assert serve.change(rate) == "+50% (+50%..+50%)"
    # warm compares with none, again (vLLM's own caches help both), pass by pass.
    assert warm["versus"]["baseline"] == "none, again"
    assert warm["versus"]["requests_per_s"]["passes"] == pytest.approx([1.0, 1.0, 1.0])


def test_a_change_has_a_confidence_interval_for_its_median() -> None:
    # 3 passes: the lowest and highest ratio, 75% confident; 5 passes: 94%.
    assert serve.median_interval([0.3, -0.1, 0.2]) == {
        "interval": [-0.1, 0.3], "rank": 1, "confidence": 0.75
    }  # fmt: skip
    assert serve.median_interval([5, 1, 4, 2, 3])["confidence"] == pytest.approx(0.9375)
    # 10 passes: one outlier each way does not decide it (2nd lowest to 2nd highest, 98%).
    ratios = [-0.4, 0.1, 0.12, 0.15, 0.2, 0.22, 0.25, 0.3, 0.33, 0.9]
    ten = serve.median_interval(ratios)
    assert ten["interval"] == [0.1, 0.33] and ten["rank"] == 2
    assert ten["confidence"] == pytest.approx(1 - 2 * 11 / 1024)
    rows = serve.summarize(
        [_row("none", [1.0] * 10, [100] * 10), _row("cold", [1 + r for r in ratios], [100] * 10)]
    )
    rate = rows[1]["versus"]["requests_per_s"]
    assert rate["within_noise"] is False and serve.change(rate) == "+21% (+10%..+33%)"
    words = serve.interval_words({"rows": rows}) or ""
    assert "a 98% confidence interval for that median" in words
    assert "the 2nd lowest to 2nd highest of the 10 ratios" in words


def test_summarize_is_idempotent() -> None:
    rows = [_row("none", [4.0, 5.0], [1, 2]), _row("cold", [3.0, 4.5], [2, 2])]
    once = serve.summarize(rows)
    assert serve.summarize(once) == once


def test_readme_block_is_replaced_in_place() -> None:
    marks = serve.README_BLOCK
    text = f"intro\n{marks.begin}\nold table\n{marks.end}\nafter\n"
    block = f"{marks.begin}\nnew table\n{marks.end}\n"
    assert marks.replaced(text, block) == f"intro\n{block}after\n"
    assert marks.cited(marks.replaced(text, block)) == block


def test_a_second_run_is_checked_against_the_first_runs_spread() -> None:
    def run(commit: str, rates: list[float], ttfts: list[float]) -> dict[str, Any]:
        meta = {"commit": commit * 40, "started": "2026-12-07 20:00:00 +0000"}
        return {"meta": meta, "rows": serve.summarize([_row("none", rates, ttfts)])}

    first = run("a", [4.0, 5.0, 6.0], [100, 200, 300])
    inside = run("b", [5.5, 5.9, 6.2], [150, 250, 260])
    outside = run("c", [6.1, 6.5, 7.0], [150, 250, 260])
    assert serve.reproduction(first, inside).splitlines()[-1].endswith("| yes |")
    assert serve.reproduction(first, outside).splitlines()[-1].endswith("| no |")


def _run(commit: str, rows: list[dict[str, Any]], passes: int = 3) -> dict[str, Any]:
    meta = {"commit": commit * 40, "started": f"2026-12-07 2{commit}:00:00 +0000"}
    share = {"request_ms": 80.0, "encoder_ms": 40.0, "encoder_share": 0.5}
    return {
        "meta": meta,
        "workload": {"profile": "bench", "passes": passes},
        "interleaved": True,
        "hold_ms": 200,
        "encoder_share": share,
        "warmup": {},
        "rows": serve.summarize(rows),
    }


def test_pooled_runs_cover_the_drift_between_them() -> None:
    connector = {"vllm:ec_cache_hits_total": 30.0}
    fast = _run(
        "1",
        [
            _row("none", [5.0, 5.2, 5.4], [100, 100, 100]),
            {**_row("other node", [7.5, 7.8, 8.1], [50, 50, 50]), "connector": connector},
        ],
    )
    # The machine 20% slower in the second run, every row alike: a run's own passes
    # miss that; the change against the baseline holds within each run.
    slow = _run(
        "2",
        [
            _row("none", [4.0, 4.16, 4.32], [120, 120, 120]),
            {**_row("other node", [6.0, 6.24, 6.48], [60, 60, 60]), "connector": connector},
        ],
    )
    slow["encoder_share"] = {"request_ms": 90.0, "encoder_ms": 44.0, "encoder_share": 0.49}
    pooled = serve.pooled([fast, slow])
    none, other = pooled["rows"]
    assert none["spread"]["requests_per_s"] == [4.0, 5.4]
    assert none["requests_per_s"] == pytest.approx((4.32 + 5.0) / 2)
    assert [p["run"] for p in none["passes"]] == [0, 0, 0, 1, 1, 1]
    assert other["versus"]["requests_per_s"]["passes"] == pytest.approx([0.5] * 6)
    assert other["versus"]["requests_per_s"]["within_noise"] is False
    assert other["completed"] == 20 and other["connector"] == {"vllm:ec_cache_hits_total": 60}
    assert pooled["encoder_share"]["encoder_ms"] == pytest.approx(42.0)
    assert serve.passes_text(pooled).startswith("6 passes (2 runs at")
    assert "2 runs, pooled: commit 1111111111" in provenance.run_line(pooled["meta"])
    # Each run alone: the other run's median falls outside its spread; pooled, inside.
    third = _run("3", [_row("none", [4.6, 4.8, 5.0], [110, 110, 110])])
    assert serve.reproduction(fast, third).splitlines()[-1].endswith("| no |")
    assert serve.reproduction(pooled, third).splitlines()[2].endswith("| yes |")


def test_only_runs_of_one_workload_pool() -> None:
    one = _run("1", [_row("none", [5.0, 5.2, 5.4], [100, 100, 100])])
    other = _run("2", [_row("none", [5.0, 5.2], [100, 100])], passes=2)
    with pytest.raises(ValueError, match="differ in workload"):
        serve.pooled([one, other])
    renamed = _run("2", [_row("cold", [5.0, 5.2, 5.4], [100, 100, 100])])
    with pytest.raises(ValueError, match="differ in their rows"):
        serve.pooled([one, renamed])
    with pytest.raises(ValueError, match="not pooled results"):
        serve.pooled([serve.pooled([one, one]), one])


def test_a_run_without_baselines_renders() -> None:
    """``--smoke`` runs cold, warm and S3 replica only: no row has its baseline."""
    results = _run("1", [_row("cold", [5.0, 5.2], [100, 100]), _row("warm", [7.0, 7.1], [50, 60])])
    results["workload"] = dataclasses.asdict(serve.SMOKE)
    text = serve.markdown(results)
    assert "No row's baseline ran: no `vs` cells." in text
    assert "| warm | 55 (50-60) | - |" in text
