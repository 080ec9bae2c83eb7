"""Qwen2-VL models with random weights, built offline (no download), for a real vLLM
engine on the CPU. The weights are random but seeded: every build gives the same model.

* ``tiny`` (tests/vllm_engine): one vision block, two text layers, hidden size 128;
  loads and answers in seconds. Its encoder is a small share of a request's work.
* ``bench`` (bench/serve.py): a vision tower that costs about as much of an image
  prompt's prefill as real ones do of theirs relative to their language model
  (six vision blocks of 448, six text layers of 512: about 58% of a 224x224-image
  request here, measured by bench/encoder_share.py), and images of 16 to 64 encoder tokens.

Both use a byte-level BPE tokenizer with the Qwen special tokens.

    python -m testkit.qwen2vl DIR [--profile tiny|bench]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
VOCAB_SIZE = 320  # 256 byte tokens, the specials, padding

# Qwen2-VL's own template, cut to what the tests send (text and images).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Profile:
    text: dict[str, Any]  # Qwen2VLConfig.text_config, beyond the token ids
    vision: dict[str, Any]  # Qwen2VLConfig.vision_config
    min_pixels: int  # images are resized to between these pixel counts
    max_pixels: int


PROFILES = {
    # 56x56 to 112x112 pixels: 4 to 16 encoder tokens an image.
    "tiny": Profile(
        text={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            # halves of the head's rotary dimensions for time, height, width
            "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6]},
        },
        vision={"depth": 1, "embed_dim": 64, "num_heads": 2, "mlp_ratio": 2},
        min_pixels=56 * 56,
        max_pixels=112 * 112,
    ),
    # 112x112 to 224x224 pixels: 16 to 64 encoder tokens of 512 floats an image.
    "bench": Profile(
        text={
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12]},
        },
        vision={"depth": 6, "embed_dim": 448, "num_heads": 7, "mlp_ratio": 4},
        min_pixels=112 * 112,
        max_pixels=224 * 224,
    ),
}


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: i for i, char in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={},
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def token_id(name: str) -> int:
    return 256 + SPECIAL_TOKENS.index(name)


def build(path: Path, profile: str = "tiny") -> Path:
    """Write the ``profile`` model to ``path`` (config, weights, tokenizer, processor)."""
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    sizes = PROFILES[profile]
    path.mkdir(parents=True, exist_ok=True)
    _tokenizer(path)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": VOCAB_SIZE,
            **sizes.text,
            "max_position_embeddings": 8192,
            "bos_token_id": token_id("<|endoftext|>"),
            "eos_token_id": token_id("<|im_end|>"),
            "pad_token_id": token_id("<|endoftext|>"),
        },
        vision_config={
            **sizes.vision,
            "hidden_size": sizes.text["hidden_size"],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    # Random init leaves some weights near zero; a wider spread makes the logits (and
    # so the comparison of logprobs) depend visibly on every input row.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)

    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            min_pixels=sizes.min_pixels, max_pixels=sizes.max_pixels
        ),
        tokenizer=AutoTokenizer.from_pretrained(path),
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": token_id("<|im_end|>"), "do_sample": False})
    )
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build a random-weight Qwen2-VL offline.")
    parser.add_argument("path", type=Path)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="tiny")
    args = parser.parse_args()
    print(build(args.path, args.profile))
