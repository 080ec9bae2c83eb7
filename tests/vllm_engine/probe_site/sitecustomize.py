"""Encoder probe for vLLM server processes (on PYTHONPATH only in tests/vllm_engine).

vLLM's API server runs its engine core in a process of its own, so the probe is
installed in every Python process that has ``EC_TEST_ENCODER_LOG`` set: when vLLM's
Qwen2-VL module is imported, its vision transformer is wrapped so that each call
appends the patch-row count it encoded to that file.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

_MODULE = "vllm.model_executor.models.qwen2_vl"


def _wrap(module: ModuleType, log_path: str) -> None:
    original = module.Qwen2VisionTransformer.forward

    def forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        with open(log_path, "a") as log:
            log.write(f"{int(x.shape[0])}\n")
        return original(self, x, *args, **kwargs)

    module.Qwen2VisionTransformer.forward = forward


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
                _wrap(module, log_path)

        spec.loader = Loader()
        return spec


if os.environ.get("EC_TEST_ENCODER_LOG"):
    sys.meta_path.insert(0, _Finder(os.environ["EC_TEST_ENCODER_LOG"]))
