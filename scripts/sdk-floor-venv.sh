#!/usr/bin/env bash
# Create .venv-sdk-floor: the SDK (editable) with each of its dependencies but torch at
# the lowest version client/pyproject.toml admits (its `>=` bound), and the test tools
# tests/client needs, so CI proves the declared ranges true at their floor.
#
#   scripts/sdk-floor-venv.sh                      # create or update ./.venv-sdk-floor
#   EC_SERVER_PYTHON=.venv/bin/python .venv-sdk-floor/bin/python -m pytest tests/client
#
# torch stays the local CPU build (scripts/venv-lib.sh): its floor (2.1) is not tested.
# The SDK's tests start the server with $EC_SERVER_PYTHON (the server's own venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-sdk-floor}"
NAME=sdk-floor-venv
TORCH_VERSION="2.13.0"
# shellcheck source=scripts/venv-lib.sh
source "$ROOT/scripts/venv-lib.sh"

# "httpx>=0.27,<1" -> "httpx==0.27": every dependency and the numpy extra, torch aside.
mapfile -t FLOORS < <("$VENV/bin/python" - "$ROOT/client/pyproject.toml" <<'PY'
import re, sys, tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["numpy"]:
    name, lowest = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(,<.*)?", requirement).group(1, 2)
    if name != "torch":
        print(f"{name}=={lowest}")
PY
)
echo "$NAME: ${FLOORS[*]}"
"${PIP[@]}" "${FLOORS[@]}" pytest pytest-timeout hypothesis google-crc32c safetensors uvloop ruff
"${PIP[@]}" --no-deps -e "$ROOT/client"

"$VENV/bin/python" - "${FLOORS[@]}" <<'PY'
import sys
from importlib.metadata import version

for pin in sys.argv[1:]:
    name, wanted = pin.split("==")
    got = version(name)
    assert tuple(map(int, got.split(".")[:len(wanted.split("."))])) == tuple(
        map(int, wanted.split("."))
    ), f"{name} {got} is not the floor {wanted}"
import ec_cache  # noqa: F401
print("sdk-floor-venv: ok:", ", ".join(f"{p.split('==')[0]} {version(p.split('==')[0])}" for p in sys.argv[1:]))
PY
