"""The encoder probe of the engine runs: counts the patch rows Qwen2-VL's vision
transformer encodes, by wrapping vLLM's own module.

``wrap_encoder`` is what the offline runner (``engine_run``) calls. vLLM's API server
runs its engine core in a process of its own, so for servers this file is also a
``sitecustomize`` (on the PYTHONPATH of tests/vllm_engine/test_epd.py's servers): in every Python process
that has ``EC_TEST_ENCODER_LOG`` set, the module is wrapped when imported and each call
appends its row count to that file.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

_MODULE = "vllm.model_executor.models.qwen2_vl"


def wrap_encoder(module: ModuleType, on_call: Callable[[int], None]) -> None:
    """Make every call of ``module``'s vision transformer report its patch rows."""
    original = module.Qwen2VisionTransformer.forward

    def forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        on_call(int(x.shape[0]))
        return original(self, x, *args, **kwargs)

    module.Qwen2VisionTransformer.forward = forward


def _append_to(log_path: str) -> Callable[[int], None]:
    def append(rows: int) -> None:
        with open(log_path, "a") as log:
            log.write(f"{rows}\n")

    return append


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, log_path: str) -> None:
        self.log_path = log_path

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, log_path = spec.loader, self.log_path

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                wrap_encoder(module, _append_to(log_path))

        spec.loader = Loader()
        return spec


if os.environ.get("EC_TEST_ENCODER_LOG"):
    sys.meta_path.insert(0, _Finder(os.environ["EC_TEST_ENCODER_LOG"]))
