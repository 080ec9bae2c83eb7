"""The figures the docs cite are the figures their results JSON holds.

Each case is one set of results JSONs and the documents that quote them: the documents
must equal what the bench's own renderer makes of the JSON (README.md's "What it saves"
and "Performance" blocks, bench/results/serve*.md, latest.md, s3-readthrough.md,
break-even.md, claims-serve.md, the claims sentence of README.md, the engine-stall
figures of docs/vllm.md), so a figure edited by hand, or a JSON replaced without
rendering again (``python -m bench.serve --render``, ``python -m bench --render``),
fails here. Every JSON must say which commit, date and machine produced it (each run's,
for pooled results). Nothing is run: this reads files. A new pair is one more entry in
``CASES``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench import break_even, claims_serve, report, s3_readthrough, serve

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"


def _json(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


@dataclass(frozen=True)
class Case:
    """``jsons``' results, and each document's cited text next to its rendering."""

    jsons: tuple[str, ...]
    #: (what is compared, the cited text, the text rendered from the JSONs)
    pairs: Callable[[], list[tuple[str, str, str]]]


def _serve_pairs() -> list[tuple[str, str, str]]:
    full, tiny = _json("serve.json"), _json("serve-tiny.json")
    return [
        ("bench/results/serve.md", (RESULTS / "serve.md").read_text(), serve.markdown(full)),
        (
            "bench/results/serve-tiny.md",
            (RESULTS / "serve-tiny.md").read_text(),
            serve.markdown(tiny),
        ),
        (
            "README.md, What it saves",
            serve.README_BLOCK.cited(README.read_text()),
            serve.readme_block(full, tiny),
        ),
    ]


def _claims_pairs() -> list[tuple[str, str, str]]:
    results = _json("claims-serve.json")
    pairs = results["pairs"]
    sentence = (
        f"{pairs['claims']['summary']['encodes_per_image']['median']:.2f} encodes per image "
        f"against {pairs['no claims']['summary']['encodes_per_image']['median']:.2f} "
        "without claims"
    )
    readme = re.sub(r"\s+", " ", README.read_text())
    cited = re.search(r"[\d.]+ encodes per image against [\d.]+ without claims", readme)
    return [
        (
            "bench/results/claims-serve.md",
            (RESULTS / "claims-serve.md").read_text(),
            claims_serve.markdown(results),
        ),
        ("README.md, encode once per cluster", cited.group(0) if cited else "", sentence),
    ]


def _stalls_pairs() -> list[tuple[str, str, str]]:
    """docs/vllm.md's figures from ``make bench-vllm-stalls``: the connector before
    asynchronous loads (``--sdk``, vllm-stalls-add7e74.json) against ``before``
    (``load_mode: sync``, ``exists_wait_s: 1``) and ``after`` (the defaults)."""
    old = _json("vllm-stalls-add7e74.json")["figures"]["sdk"]
    new = _json("vllm-stalls.json")["figures"]
    before, after = new["before"], new["after"]
    rendered = [
        f"took {old['exists_schedule_max_s'] * 1000:.0f} ms with the connector before this "
        f"design and {after['exists_schedule_max_s'] * 1000:.1f} ms with the question in the "
        f"background ({before['exists_schedule_max_s'] * 1000:.0f} ms with `exists_wait_s: 1`",
        f"was {old['hold_max_gap_s']:.2f} s with the connector before this design "
        f"({before['hold_max_gap_s']:.2f} s with `load_mode: sync`)",
        f"With asynchronous loads it was {after['hold_max_gap_s']:.2f} s (median "
        f"{after['hold_median_gap_s'] * 1000:.1f} ms); the image request alone waited "
        f"({after['hold_image_wait_s']:.1f} s)",
    ]
    doc = re.sub(r"\s+", " ", (ROOT / "docs" / "vllm.md").read_text())
    return [("docs/vllm.md", text if text in doc else "(not found)", text) for text in rendered]


def _break_even_pairs() -> list[tuple[str, str, str]]:
    """bench/results/break-even.md (tests/bench/test_break_even.py also recomputes its
    figures, and README.md's break-even sentence, from the raw numbers)."""
    rendered = break_even.markdown(_json("break-even.json"))
    return [("bench/results/break-even.md", (RESULTS / "break-even.md").read_text(), rendered)]


def _s3_readthrough_pairs() -> list[tuple[str, str, str]]:
    """bench/results/s3-readthrough.md, which bench/README.md and docs/s3.md cite."""
    rendered = s3_readthrough.markdown(_json("s3-readthrough.json"))
    cited = (RESULTS / "s3-readthrough.md").read_text()
    return [("bench/results/s3-readthrough.md", cited, rendered)]


def _latest_pairs() -> list[tuple[str, str, str]]:
    """bench/results/latest.md and README.md's Performance block (``python -m bench``)."""
    results = _json("latest.json")
    return [
        (
            "bench/results/latest.md",
            (RESULTS / "latest.md").read_text(),
            report.latest_markdown(results),
        ),
        (
            "README.md, Performance",
            report.README_BLOCK.cited(README.read_text()),
            report.readme_block(results),
        ),
    ]


CASES = {
    "break-even": Case(("break-even.json",), _break_even_pairs),
    "latest": Case(("latest.json",), _latest_pairs),
    "s3-readthrough": Case(("s3-readthrough.json",), _s3_readthrough_pairs),
    "serve": Case(("serve.json", "serve-tiny.json"), _serve_pairs),
    "claims-serve": Case(("claims-serve.json",), _claims_pairs),
    "vllm-stalls": Case(("vllm-stalls.json", "vllm-stalls-add7e74.json"), _stalls_pairs),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_docs_cite_their_json(name: str) -> None:
    for what, cited, rendered in CASES[name].pairs():
        assert cited == rendered, f"{what} differs from {CASES[name].jsons}: {rendered!r}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_results_say_what_produced_them(name: str) -> None:
    metas = {json_name: _json(json_name)["meta"] for json_name in CASES[name].jsons}
    runs = [
        (json_name, run) for json_name, meta in metas.items() for run in meta.get("runs") or [meta]
    ]
    for json_name, meta in runs:
        assert re.fullmatch(r"[0-9a-f]{40}", meta["commit"]), json_name
        assert meta.get("started") or meta.get("date"), json_name
        machine = meta["machine"] or {}
        if "added afterwards" in (meta.get("note") or "").lower():
            # Results that predate run metadata say so and keep what the run recorded.
            assert machine == {} or "node" in machine, json_name
        else:
            assert meta["dirty"] in (True, False), json_name
            assert {"node", "cpus", "cpu", "memory_gib", "python"} <= set(machine), json_name
