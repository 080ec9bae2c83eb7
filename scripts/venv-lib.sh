# Shared by the setup-*-venv.sh scripts (sourced, not run): a venv at $VENV with the
# local CPU torch, and pip that never resolves torch itself.
#
# Before sourcing: ROOT, VENV, NAME (the prefix of progress lines), TORCH_VERSION.
# TORCH_INDEX (optional, as for `make`): the index torch comes from, e.g.
# https://download.pytorch.org/whl/cpu for the CPU build where PyPI's is a CUDA one.

PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "$NAME: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --quiet)

have() {  # have DIST VERSION: the venv already holds that exact version
    "$VENV/bin/python" - "$1" "$2" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version(sys.argv[1]).split("+")[0] == sys.argv[2] else 1)
PY
}

# torch first (the CPU build this machine has locally): every later install is
# --no-deps or satisfied by it, so pip never pulls a CUDA build of several GB.
if ! have torch "$TORCH_VERSION"; then
    echo "$NAME: torch==$TORCH_VERSION"
    "${PIP[@]}" "torch==$TORCH_VERSION" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
fi
