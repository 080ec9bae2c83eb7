#!/usr/bin/env bash
# Build .whl/ (git-ignored): every wheel the GPU benchmark (bench/gpu.py) needs on the
# H200 machine beyond what its image has, which reaches no package registry. The image
# has Python 3.12 with torch, httpx/httpcore, h11, numpy, safetensors, uvloop, click,
# idna, certifi, urllib3, python-dateutil and six, which the server and the SDK use as
# they are. Run here, where pip reaches PyPI; then carry ".whl" (see
# bench/README.md, "GPU path", for the device command).
#
#   bash bench/gpu_wheels.sh            # -> .whl/*.whl, at most 64 MiB in all
#
# The server's runtime dependencies are pinned to the versions the test environment
# runs (pyproject.toml's ranges), downloaded with --no-deps so that pip never resolves
# another torch; the project itself (ec-cache-server and the ec-cache SDK) is built
# from this checkout.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/.whl"
PYTHON="${PYTHON:-python3}"
LIMIT=$((64 * 1024 * 1024))

# Server dependencies the H200 image lacks (or has at an unknown version: anyio,
# prometheus-client, typing-extensions), as pinned in the test environment.
# uvicorn's "standard" extras that the server does not use (websockets, watchfiles) and
# boto3's CRT (awscrt) are left out: app/__main__.py runs uvicorn with httptools and
# uvloop, and the benchmark runs the server without S3 (boto3 is still imported).
SERVER_DEPS=(
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 anyio==4.16.0
  pydantic-settings==2.16.3 python-dotenv==1.2.4
  uvicorn==0.55.0 httptools==0.9.0
  prometheus-client==0.26.0 crc32c==2.9.post0 python-json-logger==4.2.0
  boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3 jmespath==1.1.0
)

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
