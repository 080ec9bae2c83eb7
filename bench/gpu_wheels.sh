#!/usr/bin/env bash
# Build .whl/ (git-ignored): every wheel the GPU benchmark (bench/gpu.py) needs on the
# lent GPU machine (H100 or H200) beyond what its image has, which reaches no package registry. The image
# has Python 3.12 with torch, httpx/httpcore, h11, numpy, safetensors, uvloop, click,
# idna, certifi, urllib3, python-dateutil and six, which the server and the SDK use as
# they are. Run here, where pip reaches PyPI; then carry ".whl" (see
# bench/README.md, "GPU path", for the device command).
#
#   bash bench/gpu_wheels.sh            # -> .whl/*.whl, at most 64 MiB in all
#
# Dependencies are downloaded with --no-deps (below), so that pip never resolves
# another torch; the project itself (ec-cache-server and the ec-cache SDK) is built
# from this checkout.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/.whl"
PYTHON="${PYTHON:-python3}"
LIMIT=$((64 * 1024 * 1024))

# The server's locked dependencies (requirements.lock: exact versions) but boto3's CRT
# (awscrt: the benchmark runs the server without S3), and the connector's cachetools
# (the SDK's `vllm` extra; bench/gpu.py drives the connector's save path).
mapfile -t SERVER_DEPS < <(grep -oE '^[A-Za-z0-9_.-]+==[^ ;\\]+' "$ROOT/requirements.lock" | grep -v '^awscrt==')
SERVER_DEPS+=(cachetools==8.0.3)

PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done

rm -rf "$OUT"
mkdir -p "$OUT"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
  --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d "$OUT" "${SERVER_DEPS[@]}"
# The project: pure-Python wheels from this checkout (setuptools from this environment).
"$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  -w "$OUT" "$ROOT" "$ROOT/client"
rm -rf "$ROOT/build" "$ROOT/client/build"

total=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
ls -l "$OUT"
echo "$(ls "$OUT"/*.whl | wc -l) wheels, $((total / 1024)) KiB in $OUT"
if [ "$total" -gt "$LIMIT" ]; then
  echo "error: .whl/ is over 64 MiB (the device machine's carry limit)" >&2
  exit 1
fi
