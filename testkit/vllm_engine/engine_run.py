"""One real vLLM engine run, in a process of its own: ``python -m testkit.vllm_engine.engine_run SPEC OUT``.

SPEC (JSON) names the model, the ``--ec-transfer-config`` (or none) and the prompts;
OUT receives, per prompt, the generated token ids and their logprobs, plus how often
the vision encoder ran (counted by wrapping vLLM's own encoder module, so "the encoder
was skipped" is a measurement), how long ``generate`` took, and the connectors'
counters. With ``go`` (``host:port``), the engine, once built, waits there for a go
before it generates.

With ``scenarios`` instead of ``prompts`` (see ``scenarios.py``) the
engine is stepped by hand: requests arrive while others decode, some are aborted, and
OUT receives per scenario each request's tokens with the time each one appeared, the
duration of every ``Scheduler.schedule`` call, the encoder calls and the connectors'
counters. Before each scenario its fault settings are posted to SPEC's ``proxy_url``.

Prompt images are drawn from a seed, so every process sees the same pixels.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

IMAGE_SIDE = 84  # pixels; the tiny model's processor makes 9 encoder tokens of it
#: The longest a scenario waits past its settle_s for its settle_on counter to move.
SETTLE_ON_MAX_S = 20.0


def image(seed: int) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3))
    return Image.fromarray(pixels.astype("uint8"), "RGB")


def prompt(text: str, image_seeds: list[int]) -> dict[str, Any]:
    pads = "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in image_seeds)
    return {
        "prompt": f"<|im_start|>user\n{pads}{text}<|im_end|>\n<|im_start|>assistant\n",
        "multi_modal_data": {"image": [image(seed) for seed in image_seeds]},
    }


class EncoderProbe:
    """Counts calls of Qwen2-VL's vision transformer and the patch rows it encoded."""

    def __init__(self) -> None:
        self.calls = 0
        self.rows = 0

    def install(self) -> None:
        from vllm.model_executor.models import qwen2_vl

        from testkit.vllm_engine.probe_site.sitecustomize import wrap_encoder

        wrap_encoder(qwen2_vl, self._count)

    def _count(self, rows: int) -> None:
        self.calls += 1
        self.rows += rows


def perturb_loads() -> None:
    """Negative control: every tensor the connector loads is nudged by 1e-2."""
    from ec_cache.vllm import ECCacheConnector

    original = ECCacheConnector.start_load_caches

    def start_load_caches(self: Any, encoder_cache: dict[str, Any], **kwargs: Any) -> None:
        before = set(encoder_cache)
        original(self, encoder_cache, **kwargs)
        for key in set(encoder_cache) - before:
            encoder_cache[key] = encoder_cache[key] + 1e-2

    ECCacheConnector.start_load_caches = start_load_caches  # type: ignore[method-assign,unused-ignore]


def completion_of(out: Any) -> dict[str, Any]:
    completion = out.outputs[0]
    logprobs = [
        step[token].logprob
        for step, token in zip(completion.logprobs or [], completion.token_ids, strict=True)
    ]
    return {"token_ids": list(completion.token_ids), "logprobs": logprobs}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    probe = EncoderProbe()
    probe.install()
    if spec.get("perturb_loads"):
        perturb_loads()
    kwargs: dict[str, Any] = {}
    if spec.get("ec_transfer_config"):
        kwargs["ec_transfer_config"] = spec["ec_transfer_config"]
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 512),
        max_num_seqs=8,
        seed=0,
        limit_mm_per_prompt={"image": 4},
        **kwargs,
    )
    if "scenarios" in spec:
        return run_scenarios(llm, probe, spec)
    connectors = Connectors(llm) if spec.get("ec_transfer_config") else None
    if spec.get("go"):
        wait_for_go(spec["go"])
    params = SamplingParams(
        temperature=0.0, max_tokens=spec.get("max_tokens", 8), logprobs=1, seed=0
    )
    prompts = [prompt(p["text"], p["images"]) for p in spec["prompts"]]
    probe.calls = probe.rows = 0  # count the requests' encoding, not start-up profiling
    started = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.monotonic() - started
    return {
        "outputs": [completion_of(out) for out in outputs],
        "encoder_calls": probe.calls,
        "encoder_rows": probe.rows,
        "generate_seconds": seconds,
        "counters": connectors.counters() if connectors is not None else {},
    }


def wait_for_go(address: str) -> None:
    """Built and ready: say so to ``host:port`` and wait for its go (one byte), so that
    a test starts several engines' requests when it chooses, not when each is built."""
    import socket

    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=600) as sock:
        sock.sendall(b"r")
        if not sock.recv(1):
            raise RuntimeError("the test went away before its go")


class Connectors:
    """The engine's connectors (scheduler and, in this process, the worker) and the
    durations of ``Scheduler.schedule``."""

    def __init__(self, llm: Any) -> None:
        from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

        core = llm.llm_engine.engine_core.engine_core  # VLLM_ENABLE_V1_MULTIPROCESSING=0
        scheduler = core.scheduler
        self.scheduler = scheduler.ec_connector
        self.worker = get_ec_transfer() if has_ec_transfer() else None
        self.schedule_seconds: list[float] = []
        schedule = scheduler.schedule

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return schedule(*args, **kwargs)
            finally:
                self.schedule_seconds.append(time.perf_counter() - started)

        scheduler.schedule = timed

    def counters(self) -> dict[str, dict[str, float]]:
        return {
            role: connector.counters() if connector is not None else {}
            for role, connector in (("scheduler", self.scheduler), ("worker", self.worker))
        }


def run_scenarios(llm: Any, probe: EncoderProbe, spec: dict[str, Any]) -> dict[str, Any]:
    import httpx

    connectors = Connectors(llm)
    results = []
    for scenario in spec["scenarios"]:
        if spec.get("proxy_url"):
            httpx.post(f"{spec['proxy_url']}/_fault", json=scenario["proxy"]).raise_for_status()
        results.append(run_scenario(llm, probe, connectors, scenario, spec.get("aborts", True)))
    return {"scenarios": results}


def run_scenario(
    llm: Any, probe: EncoderProbe, connectors: Connectors, scenario: dict[str, Any], aborts: bool
) -> dict[str, Any]:
    """Step the engine through one scenario: each request arrives when its
    ``after`` condition holds (another request has that many tokens); ``abort_after_s``
    aborts it that long after its arrival (unless not ``aborts``); once every request
    but the ``background`` one is done, the scenario waits ``settle_s`` (stepping), and
    with ``settle_on`` until that connector counter moved and two steps ran after it
    (at most ``SETTLE_ON_MAX_S`` more), then aborts the rest."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    before = connectors.counters()
    encoder_calls = probe.calls
    schedule_from = len(connectors.schedule_seconds)
    started = time.monotonic()
    waiting = list(scenario["requests"])
    records: dict[str, dict[str, Any]] = {}
    background = scenario.get("background")

    def clock() -> float:
        return time.monotonic() - started

    def due(request: dict[str, Any]) -> bool:
        after = request.get("after")
        if after is None:
            return True
        record = records.get(after["request"])
        return record is not None and len(record["token_times"]) >= after["tokens"]

    def foreground_done() -> bool:
        return not waiting and all(
            r["finished_at"] is not None for name, r in records.items() if name != background
        )

    settle_until: float | None = None
    settle_on = scenario.get("settle_on")  # [role, counter]: settle once it moved
    moved_at: int | None = None  # the step count when it did
    steps: list[tuple[float, float]] = []  # (start, seconds) of each engine step
    while True:
        for request in [r for r in waiting if due(r)]:
            waiting.remove(request)
            params = SamplingParams(
                temperature=0.0,
                max_tokens=request["max_tokens"],
                ignore_eos=request.get("ignore_eos", False),
                logprobs=1,
                seed=0,
            )
            engine.add_request(request["id"], prompt(request["text"], request["images"]), params)
            records[request["id"]] = {
                "added_at": clock(),
                "token_times": [],
                "finished_at": None,
                "aborted": False,
                "abort_at": clock() + request["abort_after_s"]
                if aborts and "abort_after_s" in request
                else None,
            }
        for name, record in records.items():
            if record["abort_at"] is not None and clock() >= record["abort_at"]:
                record["abort_at"] = None
                record["aborted"] = True
                record["finished_at"] = clock()
                engine.abort_request([name])
        if foreground_done():
            settle_until = settle_until or clock() + scenario.get("settle_s", 0.0)
            if settle_on is not None and moved_at is None:
                role, counter = settle_on
                if connectors.counters()[role].get(counter, 0) > before[role].get(counter, 0):
                    moved_at = len(steps)
            # A worker's count reaches the scheduler with its report in a later step.
            moved = settle_on is None or (moved_at is not None and len(steps) >= moved_at + 2)
            if clock() >= settle_until and (moved or clock() >= settle_until + SETTLE_ON_MAX_S):
                break
        step_started = clock()
        outputs = engine.step() if engine.has_unfinished_requests() else []
        now = clock()
        steps.append((step_started, now - step_started))
        for out in outputs:
            record = records[out.request_id]
            new = len(out.outputs[0].token_ids) - len(record["token_times"])
            record["token_times"].extend([now] * new)
            if out.finished and record["finished_at"] is None:
                record["finished_at"] = now
                record.update(completion_of(out))
                if out.request_id == background and not foreground_done():
                    raise RuntimeError(
                        f"{scenario['name']}: the background request finished before the "
                        "others: give it more max_tokens (scenarios.TEXT_TOKENS)"
                    )
        if not outputs:
            time.sleep(0.001)  # let the connector's threads run (as EngineCore's loop does)
    leftover = [name for name, r in records.items() if r["finished_at"] is None]
    if leftover:
        engine.abort_request(leftover)
        while engine.has_unfinished_requests():
            engine.step()
    return {
        "name": scenario["name"],
        "requests": records,
        "schedule_seconds": connectors.schedule_seconds[schedule_from:],
        "steps": steps,
        "encoder_calls": probe.calls - encoder_calls,
        "counters_before": before,
        "counters_after": connectors.counters(),
    }


if __name__ == "__main__":
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    out_path.write_text(json.dumps(run(json.loads(spec_path.read_text()))))
