"""One real vLLM engine run, in a process of its own: ``python -m tests.vllm_engine.engine_run SPEC OUT``.

SPEC (JSON) names the model, the ``--ec-transfer-config`` (or none) and the prompts;
OUT receives, per prompt, the generated token ids and their logprobs, plus how often
the vision encoder ran (counted by wrapping vLLM's own encoder module, so "the encoder
was skipped" is a measurement) and how long ``generate`` took.

Prompt images are drawn from a seed, so every process sees the same pixels.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

IMAGE_SIDE = 84  # pixels; the tiny model's processor makes 9 encoder tokens of it


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

        from tests.vllm_engine.probe_site.sitecustomize import wrap_encoder

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

    ECCacheConnector.start_load_caches = start_load_caches  # type: ignore[method-assign]


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
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
        limit_mm_per_prompt={"image": 4},
        **kwargs,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=spec.get("max_tokens", 8), logprobs=1, seed=0
    )
    prompts = [prompt(p["text"], p["images"]) for p in spec["prompts"]]
    probe.calls = probe.rows = 0  # count the requests' encoding, not start-up profiling
    started = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.monotonic() - started
    results = []
    for out in outputs:
        completion = out.outputs[0]
        logprobs = [
            step[token].logprob
            for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        results.append({"token_ids": list(completion.token_ids), "logprobs": logprobs})
    return {
        "outputs": results,
        "encoder_calls": probe.calls,
        "encoder_rows": probe.rows,
        "generate_seconds": seconds,
    }


if __name__ == "__main__":
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    out_path.write_text(json.dumps(run(json.loads(spec_path.read_text()))))
