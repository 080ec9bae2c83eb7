"""A tiny Qwen2-VL with random weights, built offline (no download).

One vision block, two text layers, hidden size 128, and a byte-level BPE tokenizer
with the Qwen special tokens, so that a real vLLM engine loads it in seconds on the
CPU. The weights are random but seeded: every build gives the same model.

    python -m tests.vllm_engine.tiny_model DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

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

# Images are resized to between 56x56 and 112x112 pixels: 4 to 16 encoder tokens each.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112


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


def build(path: Path) -> Path:
    """Write the model to ``path`` (config, weights, tokenizer, processor)."""
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    path.mkdir(parents=True, exist_ok=True)
    _tokenizer(path)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6]},
            "bos_token_id": token_id("<|endoftext|>"),
            "eos_token_id": token_id("<|im_end|>"),
            "pad_token_id": token_id("<|endoftext|>"),
        },
        vision_config={
            "depth": 1,
            "embed_dim": 64,
            "hidden_size": 128,
            "num_heads": 2,
            "mlp_ratio": 2,
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
        image_processor=Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
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
    print(build(Path(sys.argv[1])))
