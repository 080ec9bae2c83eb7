#!/bin/sh
# The server image's install steps, in one place: the Dockerfile runs them, and so does
# tests/deploy/test_image_install.py (fresh venv, no index), so what CI tests is what
# the image installs.
#
#   server-wheels.sh build DIR     # builder stage: the locked wheels (hash-checked,
#                                  # binary only) and the server's own wheel, built by
#                                  # the backend pinned in build-backend.lock (hashes
#                                  # too, in a venv of its own), into DIR, with
#                                  # requirements.lock and this script
#   server-wheels.sh install DIR   # final stage: install from DIR only (no index,
#                                  # hashes required), then check the result
#
# `python` is the interpreter that gets the server (the image's, or a venv's).
set -eu

usage() { echo "usage: $0 build|install DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
step=$1
wheels=$2
pip() { python -m pip --disable-pip-version-check --no-cache-dir "$@"; }

case "$step" in
build)
    # Run from the project root (pyproject.toml, requirements.lock, app/).
    mkdir -p "$wheels"
    pip download --quiet --require-hashes --only-binary=:all: \
        --requirement requirements.lock --dest "$wheels"
    # The build backend from its lock, not whatever `pip wheel`'s isolated build would
    # fetch for pyproject's `requires` range that day.
    backend=$(mktemp -d)
    python -m venv "$backend"
    "$backend/bin/python" -m pip --disable-pip-version-check --no-cache-dir install \
        --quiet --require-hashes --only-binary=:all: --no-deps \
        --requirement deploy/docker/build-backend.lock
    "$backend/bin/python" -m pip --disable-pip-version-check --no-cache-dir wheel \
        --quiet --no-deps --no-build-isolation --wheel-dir "$wheels" .
    rm -rf "$backend"
    cp requirements.lock "$0" "$wheels/"
    ;;
install)
    pip install --quiet --no-index --find-links="$wheels" --require-hashes \
        --requirement "$wheels/requirements.lock"
    # The server's own wheel is built in the builder stage: it has no hash to check.
    pip install --quiet --no-index --no-deps "$wheels"/ec_cache_server-*.whl
    pip check
    # Every module the server imports at start-up, the S3 tier's CRC32C (awscrt) and
    # the event loop and HTTP parser uvicorn is told to use.
    python -c "import app.__main__, app.tiers.s3, awscrt, uvloop, httptools"
    # The image never carries torch.
    if python -c "import torch" 2>/dev/null; then
        echo "$0: torch is importable: the server image must not carry it" >&2
        exit 1
    fi
    ;;
*)
    usage
    ;;
esac
