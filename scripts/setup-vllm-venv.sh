#!/usr/bin/env bash
# Create .venv-vllm: vLLM 0.33.0 on the CPU-only torch 2.13.0, the SDK (editable) and
# pytest, for tests/vllm (the vLLM encoder-cache connector against vLLM's own classes).
#
#   scripts/setup-vllm-venv.sh            # create or update ./.venv-vllm
#   VENV=/tmp/v scripts/setup-vllm-venv.sh
#   .venv-vllm/bin/python -m pytest tests/vllm
#
# Order matters: torch==2.13.0 first (scripts/venv-lib.sh: the local CPU build); every
# later install but the SDK's is --no-deps, so pip never resolves torch itself (vLLM's metadata pins
# a CUDA torch of several GB). About 2.2 GB on disk, ~90 s with a warm pip cache.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-vllm}"
NAME=setup-vllm-venv
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.33.0"
XGRAMMAR_VERSION="0.2.8"
# shellcheck source=scripts/venv-lib.sh
source "$ROOT/scripts/venv-lib.sh"

if ! have vllm "$VLLM_VERSION" || ! have xgrammar "$XGRAMMAR_VERSION"; then
    echo "setup-vllm-venv: vllm==$VLLM_VERSION xgrammar==$XGRAMMAR_VERSION (--no-deps)"
    "${PIP[@]}" --no-deps "vllm==$VLLM_VERSION" "xgrammar==$XGRAMMAR_VERSION"
fi
echo "setup-vllm-venv: pure-Python requirements (--no-deps)"
"${PIP[@]}" --no-deps -r "$ROOT/tests/vllm/requirements.txt"
# With its own dependencies: its only torch requirement is a range that the installed
# 2.13.0 satisfies, so pip adds nothing torch-related; the check below makes sure.
echo "setup-vllm-venv: the SDK (editable)"
"${PIP[@]}" -e "$ROOT/client"

# The torch build must still be the local CPU one (nothing above may have replaced it).
"$VENV/bin/python" - <<EOF
import torch
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
from vllm.config import ECTransferConfig, VllmConfig  # noqa: F401
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: F401
import ec_cache.vllm  # noqa: F401
print("setup-vllm-venv: ok: torch", torch.__version__, "vllm", __import__("vllm").__version__)
EOF
