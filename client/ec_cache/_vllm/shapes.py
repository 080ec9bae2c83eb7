"""The shape vLLM expects of an encoder output: its rows (the item's placeholder
tokens) and its width, and why an entry of another shape is refused (no vLLM import).

vLLM measures encoder widths only on an EC producer (``mm_encoder_output_widths``, per
modality). Every worker, whatever its ``ec_role``, also knows the width from the model's
config (the language model's input embedding size; DeepStack towers append one such
block per extra level) and, once its encoder has computed an output, from that output:
what the encoder really makes overrides the config's estimate.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EncoderWidth", "check_shape", "config_width"]


def check_shape(shape: tuple[int, ...], num_embeds: int | None, width: int | None) -> str | None:
    """Why an entry of ``shape`` is not the encoder output vLLM expects, or None."""
    if len(shape) < 1:
        return "a 0-d tensor"
    if num_embeds is not None and shape[0] != num_embeds:
        return f"shape {shape}, but vLLM expects {num_embeds} rows"
    if width is not None and (len(shape) != 2 or shape[1] != width):
        return f"shape {shape}, but the encoder output is ({shape[0]}, {width})"
    return None


def config_width(model_config: Any) -> int | None:
    """The encoder output width a vLLM ``ModelConfig`` implies, or ``None`` when it
    says nothing usable: the language model's input embedding size, or for a
    DeepStack vision tower (Qwen3-VL) its output size once per level, the main one
    included (as vLLM's model concatenates them)."""
    vision = getattr(getattr(model_config, "hf_config", None), "vision_config", None)
    levels = getattr(vision, "deepstack_visual_indexes", None)
    out_size = getattr(vision, "out_hidden_size", None)
    if isinstance(levels, list | tuple) and isinstance(out_size, int):
        return out_size * (1 + len(levels))
    try:
        return int(model_config.get_inputs_embeds_size())
    except (AttributeError, TypeError, ValueError):
        return None


class EncoderWidth:
    """The width a worker expects: vLLM's measurement for the item's modality when there
    is one, else the first output its encoder computed, else the config's estimate."""

    def __init__(self, configured: int | None) -> None:
        self._configured = configured
        self._computed: int | None = None

    def learn(self, shape: tuple[int, ...]) -> None:
        """An output of this worker's encoder (the first one sets the width)."""
        if self._computed is None and len(shape) == 2:
            self._computed = int(shape[1])

    def expected(self, measured: int | None = None) -> int | None:
        """``measured`` (the scheduler's, from the item's modality) when given, else
        this worker's best knowledge."""
        if measured is not None:
            return measured
        return self._computed if self._computed is not None else self._configured
