"""The vision encoders of three real models, timed on this CPU: ms per image and per MB.

Runs in the vLLM engine venv, which has transformers (``python -m bench.break_even``
runs it there; ``.venv-vllm-engine/bin/python -m bench.encoder_time [--smoke]`` alone
prints its JSON). Each encoder is built from its model's config with random weights:
how long a forward pass takes depends on the shapes, not on the weights' values. What
is timed is what vLLM stores as the model's encoder-cache entry:

* **Qwen2.5-VL-7B**: the vision tower with its patch merger; an entry is tokens x 3584
  (the LLM's hidden size);
* **Qwen3-VL-8B**: the vision tower, its merger and its three deepstack mergers,
  concatenated as vLLM stores them: tokens x 16384 (4 x 4096);
* **LLaVA-1.5-7B**: CLIP ViT-L/14-336 up to the feature layer (-2: vLLM builds the tower
  with 23 of its 24 layers) and the 2-layer MLP projector: 576 x 4096.

The Qwen towers see a ``--qwen-image`` image (default 448x448: at 1920x1080, one pass
took 45 s (Qwen3-VL) and 63 s (Qwen2.5-VL) on one busy core of the build VM), rounded as Qwen's processor rounds it (to a
multiple of patch x merge); CLIP's is always 336x336. Attention grows with the square
of the patches, so the ms per MB of a 1080p image is higher than at 448x448 (Qwen3-VL
attends globally in every layer, Qwen2.5-VL in 4 of 32; the rest within windows).

bf16 (the entry format; this CPU has AMX, where a bf16 matmul runs ~4x an fp32 one),
``torch.inference_mode``, one warm-up pass per model, then ``--reps`` rounds in which
every model runs once (interleaved, so a busy spell slows all alike). Two tunings,
both recorded in the output:

* ``--threads`` (default 1): on the 2-core build VM, two intra-op threads made a pass
  ~4x *slower* than one whenever another process held the other core;
* glibc keeps freed blocks for reuse (``mallopt``) rather than returning each large
  one to the kernel: otherwise every activation faults in fresh pages, slow on this
  VM (~0.3 GiB/s), which halved the speed (vLLM's CPU guide preloads TCMalloc for the
  same reason).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MB = 1_000_000

#: Qwen/Qwen2.5-VL-7B-Instruct, config.json, "vision_config" (transformers'
#: Qwen2_5_VLVisionConfig defaults differ in hidden_size: 3584 there, 1280 here).
QWEN25_VL_7B: dict[str, Any] = {
    "depth": 32,
    "hidden_size": 1280,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2,
    "out_hidden_size": 3584,
}
#: Qwen/Qwen3-VL-8B-Instruct, config.json, "vision_config" (= transformers'
#: Qwen3VLVisionConfig defaults but for out_hidden_size: 3584 there, 4096 here).
QWEN3_VL_8B: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
    "out_hidden_size": 4096,
}
#: llava-hf/llava-1.5-7b-hf, config.json, "vision_config" (openai/clip-vit-large-patch14-336;
#: = the vision_config LlavaConfig builds by default).
CLIP_VIT_L_336: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 336,
    "patch_size": 14,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
}
#: llava-hf/llava-1.5-7b-hf, config.json: the projector and where it reads the tower.
LLAVA_15_7B: dict[str, Any] = {
    "text_hidden_size": 4096,
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
}
#: --smoke: the same architectures, tiny (seconds for all three).
SMOKE: dict[str, dict[str, Any]] = {
    "qwen25": {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "fullatt_block_indexes": [1],
        "out_hidden_size": 64,
    },
    "qwen3": {
        "depth": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "deepstack_visual_indexes": [0, 1],
        "out_hidden_size": 64,
    },
    "clip": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "image_size": 56,
    },
    "llava": {"text_hidden_size": 64},
}
SMOKE_QWEN_IMAGE = (112, 112)
#: glibc's mallopt parameters: freed blocks below these stay in the heap for reuse.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 32 * 1024 * 1024  # the largest mmap threshold glibc accepts on 64-bit


@dataclass
class Encoder:
    """One model's encoder, ready to run on one image."""

    payload: str  # bench/payloads.py's name for the model's 1080p entry
    model: str
    part: str
    config_source: str
    config: dict[str, Any]
    image: tuple[int, int]
    forward: Callable[[], Any]
    params: int

    def output_shape(self) -> tuple[int, int]:
        out = self.forward()
        return int(out.shape[0]), int(out.shape[1])


def qwen_grid(image: tuple[int, int], config: dict[str, Any]) -> tuple[int, int]:
    """Patches (height, width) of an image as Qwen's processor resizes it: each side
    rounded to a multiple of patch x merge (pixel limits aside)."""
    factor = config["patch_size"] * config["spatial_merge_size"]
    width, height = image
    merge = config["spatial_merge_size"]
    return max(1, round(height / factor)) * merge, max(1, round(width / factor)) * merge


def _qwen_inputs(
    config: dict[str, Any], image: tuple[int, int], dtype: Any
) -> tuple[Any, Any, tuple[int, int]]:
    import torch

    rows, cols = qwen_grid(image, config)
    patch = config["in_channels"] * config["temporal_patch_size"] * config["patch_size"] ** 2
    pixels = torch.randn(rows * cols, patch, dtype=dtype)
    pixel_size = (cols * config["patch_size"], rows * config["patch_size"])
    return pixels, torch.tensor([[1, rows, cols]]), pixel_size


def qwen25_vl(config: dict[str, Any], image: tuple[int, int], dtype: Any) -> Encoder:
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(
        Qwen2_5_VLVisionConfig(**config), dtype=dtype, attn_implementation="sdpa"
    ).eval()
    pixels, grid, size = _qwen_inputs(config, image, dtype)
    return Encoder(
        "qwen25vl-2691x3584",
        "Qwen2.5-VL-7B",
        "vision tower + patch merger",
        "Qwen/Qwen2.5-VL-7B-Instruct config.json",
        config,
        size,
        lambda: tower(pixels, grid).pooler_output,
        sum(p.numel() for p in tower.parameters()),
    )


def qwen3_vl(config: dict[str, Any], image: tuple[int, int], dtype: Any) -> Encoder:
    import torch
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    tower = Qwen3VLVisionModel._from_config(
        Qwen3VLVisionConfig(**config), dtype=dtype, attn_implementation="sdpa"
    ).eval()
    pixels, grid, size = _qwen_inputs(config, image, dtype)

    def forward() -> Any:
        out = tower(pixels, grid)
        # vLLM's entry: the merger's output and the deepstack features side by side.
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=1)

    return Encoder(
        "qwen3vl-2040x16384",
        "Qwen3-VL-8B",
        f"vision tower + merger + {len(config['deepstack_visual_indexes'])} deepstack mergers",
        "Qwen/Qwen3-VL-8B-Instruct config.json",
        config,
        size,
        forward,
        sum(p.numel() for p in tower.parameters()),
    )


def llava15(clip: dict[str, Any], llava: dict[str, Any], dtype: Any) -> Encoder:
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel, LlavaConfig
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    # vLLM builds CLIP only up to the feature layer (-2: 23 of 24 layers); its last
    # hidden state is then the feature, before any post-layernorm.
    layers = clip["num_hidden_layers"] + llava["vision_feature_layer"] + 1
    vision = CLIPVisionConfig(**{**clip, "num_hidden_layers": layers})
    tower = CLIPVisionModel._from_config(vision, dtype=dtype, attn_implementation="sdpa").eval()
    projector = (
        LlavaMultiModalProjector(
            LlavaConfig(
                vision_config=vision.to_dict(),
                text_config={"model_type": "llama", "hidden_size": llava["text_hidden_size"]},
                projector_hidden_act=llava["projector_hidden_act"],
                vision_feature_layer=llava["vision_feature_layer"],
            )
        )
        .to(dtype)
        .eval()
    )
    side = clip["image_size"]
    pixels = torch.randn(1, 3, side, side, dtype=dtype)
    skip = 1 if llava["vision_feature_select_strategy"] == "default" else 0  # the CLS token

    def forward() -> Any:
        features = tower(pixels).last_hidden_state[:, skip:]
        return projector(features)[0]

    return Encoder(
        "llava-576x4096",
        "LLaVA-1.5-7B",
        f"CLIP ViT-L/14-336 ({layers} of {clip['num_hidden_layers']} layers) + MLP projector",
        "llava-hf/llava-1.5-7b-hf config.json",
        {**clip, **llava},
        (side, side),
        forward,
        sum(p.numel() for p in [*tower.parameters(), *projector.parameters()]),
    )


def keep_freed_memory() -> str:
    """Have glibc keep freed blocks (up to ``KEEP_BYTES`` each) for reuse; see the module
    docstring. Says what it did."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return "default allocator (no glibc mallopt)"
    if mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) != 1 or mallopt(M_TRIM_THRESHOLD, 2**31 - 1) != 1:
        return "default allocator (mallopt refused)"
    return f"glibc, mmap threshold {KEEP_BYTES // 2**20} MiB, no trim"


def parse_image(text: str) -> tuple[int, int]:
    width, _, height = text.partition("x")
    return int(width), int(height)


def measure(reps: int, threads: int, qwen_image: tuple[int, int], smoke: bool) -> dict[str, Any]:
    allocator = keep_freed_memory()
    import torch
    import transformers

    torch.set_num_threads(threads)
    dtype = torch.bfloat16
    tiny: dict[str, dict[str, Any]] = SMOKE if smoke else {}
    image = SMOKE_QWEN_IMAGE if smoke else qwen_image
    torch.manual_seed(0)
    started = time.perf_counter()
    encoders = [
        qwen25_vl({**QWEN25_VL_7B, **tiny.get("qwen25", {})}, image, dtype),
        qwen3_vl({**QWEN3_VL_8B, **tiny.get("qwen3", {})}, image, dtype),
        llava15(
            {**CLIP_VIT_L_336, **tiny.get("clip", {})},
            {**LLAVA_15_7B, **tiny.get("llava", {})},
            dtype,
        ),
    ]
    built_s = time.perf_counter() - started
    seconds: dict[str, list[float]] = {e.payload: [] for e in encoders}
    shapes: dict[str, tuple[int, int]] = {}
    with torch.inference_mode():
        for encoder in encoders:  # warm-up, and the shape of what is stored
            shapes[encoder.payload] = encoder.output_shape()
        for _ in range(reps):
            for encoder in encoders:
                began = time.perf_counter()
                encoder.forward()
                seconds[encoder.payload].append(time.perf_counter() - began)
    out: dict[str, Any] = {
        "smoke": smoke,
        "dtype": "bfloat16",
        "torch_threads": threads,
        "allocator": allocator,
        "warm_up_passes": 1,
        "reps": reps,
        "build_s": round(built_s, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "encoders": {},
    }
    for encoder in encoders:
        shape = shapes[encoder.payload]
        output_bytes = shape[0] * shape[1] * 2  # bf16, the entry's format
        ms = [s * 1e3 for s in seconds[encoder.payload]]
        median_ms = statistics.median(ms)
        out["encoders"][encoder.payload] = {
            "model": encoder.model,
            "part": encoder.part,
            "config_source": encoder.config_source,
            "config": encoder.config,
            "params": encoder.params,
            "image": f"{encoder.image[0]}x{encoder.image[1]}",
            "output_shape": list(shape),
            "output_bytes": output_bytes,
            "ms": ms,
            "ms_median": median_ms,
            "ms_min": min(ms),
            "ms_max": max(ms),
            "ms_per_mb_median": median_ms / (output_bytes / MB),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed passes per model")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--qwen-image", type=parse_image, default=(448, 448), help="WxH for the Qwen towers"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny configs (a test)")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.threads < 1:
        parser.error("--reps and --threads must be at least 1")
    print(json.dumps(measure(args.reps, args.threads, args.qwen_image, args.smoke)))


if __name__ == "__main__":
    main()
