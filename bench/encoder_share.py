"""The vision encoder's share of an image prompt's prefill, for bench/serve.py's model.

Runs in the vLLM engine venv (``python -m bench.encoder_share MODEL SIDE TOKENS``): an
offline ``vllm.LLM`` answers one token for prompts of one random ``SIDE``x``SIDE`` image
and ``TOKENS`` text tokens, each with a new image, while the model's vision tower is
timed (wrapped around vLLM's own ``Qwen2VisionTransformer.forward``). Prints JSON: the
medians of the whole request (preprocessing, encoder, prefill) and of the encoder, and
their ratio, the share a cache hit can save.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

ROUNDS = 12


def main(model: str, side: int, text_tokens: int) -> dict[str, Any]:
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models import qwen2_vl

    encoder_seconds: list[float] = []
    forward = qwen2_vl.Qwen2VisionTransformer.forward

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return forward(self, *args, **kwargs)
        finally:
            encoder_seconds.append(time.perf_counter() - started)

    qwen2_vl.Qwen2VisionTransformer.forward = timed
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=1,
        limit_mm_per_prompt={"image": 1},
        enable_prefix_caching=False,
        seed=0,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def prompt(seed: int) -> dict[str, Any]:
        pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
        return {
            "prompt": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
            f"{'x' * text_tokens}<|im_end|>\n<|im_start|>assistant\n",
            "multi_modal_data": {"image": [Image.fromarray(pixels, "RGB")]},
        }

    llm.generate([prompt(10_000)], params, use_tqdm=False)  # warm-up
    encoder_seconds.clear()
    request_seconds = []
    for seed in range(ROUNDS):
        started = time.perf_counter()
        out = llm.generate([prompt(seed)], params, use_tqdm=False)
        request_seconds.append(time.perf_counter() - started)
    request_ms = statistics.median(request_seconds) * 1000
    encoder_ms = statistics.median(encoder_seconds) * 1000
    return {
        "image_side": side,
        "prompt_tokens": len(out[0].prompt_token_ids),
        "rounds": ROUNDS,
        "request_ms": round(request_ms, 1),
        "encoder_ms": round(encoder_ms, 1),
        "encoder_share": round(encoder_ms / request_ms, 3),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
