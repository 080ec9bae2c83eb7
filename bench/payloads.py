"""Benchmark payloads: real encoder output shapes and a mixed workload."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from ec_cache._tensors import build_header, tensor_memoryview

MODEL = "bench/encoder"
DTYPE = "bfloat16"
HIDDEN = 4096  # hidden size used to give mixed-workload entries a shape
MB = 1_000_000


@dataclass(frozen=True)
class Payload:
    """One entry shape (bf16); ``name`` doubles as the key prefix."""

    name: str
    shape: tuple[int, int]
    note: str = ""

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 2

    @cached_property
    def header(self) -> bytes:
        header: bytes = build_header(DTYPE, self.shape)
        return header

    @property
    def size(self) -> int:
        """Bytes on the wire and on disk: safetensors header plus data."""
        return len(self.header) + self.nbytes

    def tensor(self, seed: int) -> torch.Tensor:
        """Random bits as bf16 (fast to generate; NaNs do not matter here)."""
        raw = np.random.default_rng(seed).integers(0, 1 << 16, self.nbytes // 2, dtype=np.uint16)
        return torch.from_numpy(raw).view(torch.bfloat16).view(self.shape)

    def body(self, tensor: torch.Tensor) -> bytes:
        return self.header + bytes(tensor_memoryview(tensor))


FULL_PAYLOADS = [
    Payload("small-64x1024", (64, 1024), "small entry (128 KiB)"),
    Payload("llava-576x4096", (576, 4096), "LLaVA-1.5 image, 4.7 MB"),
    Payload("qwen25vl-2691x3584", (2691, 3584), "Qwen2.5-VL-7B 1080p, 19.3 MB"),
    Payload("qwen3vl-2040x16384", (2040, 16384), "Qwen3-VL-8B 1080p, 67 MB"),
]
QUICK_PAYLOADS = [
    Payload("small-64x1024", (64, 1024), "small entry (128 KiB)"),
    Payload("tiny-256x1024", (256, 1024), "512 KiB (quick mode)"),
]

#: (share of requests, smallest, largest) in bytes
MIX_CLASSES = [(0.6, 1 * MB, 10 * MB), (0.3, 10 * MB, 70 * MB), (0.1, 100 * MB, 270 * MB)]


def mixed_workload(count: int, scale: float = 1.0, seed: int = 7) -> list[Payload]:
    """``count`` distinct entries whose sizes follow ``MIX_CLASSES`` (exact shares,
    shuffled); ``scale`` shrinks every size (quick mode)."""
    rng = random.Random(seed)
    out: list[Payload] = []
    for share, low, high in MIX_CLASSES:
        for _ in range(max(1, round(share * count))):
            size = rng.uniform(low, high) * scale
            tokens = max(1, int(size // (HIDDEN * 2)))
            out.append(Payload(f"mix{len(out):02d}-{tokens}x{HIDDEN}", (tokens, HIDDEN)))
    rng.shuffle(out)
    return out
