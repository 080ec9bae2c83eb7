#!/usr/bin/env bash
# Every deployment check, offline: Dockerfile lint, compose validation, Helm lint and
# render with each value set, Kubernetes schema validation of everything rendered,
# then the pytest suite in tests/deploy. Exits non-zero on the first failing step.
#
#   bash deploy/check.sh              # sets up .venv-deploy first (deploy/setup.sh)
#   SKIP_SETUP=1 bash deploy/check.sh # tools already installed
#   KUBE_VERSIONS="1.29.0 1.37.0" bash deploy/check.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-deploy}"
CHART="$ROOT/helm/ec-cache"
KUBE_VERSIONS="${KUBE_VERSIONS:-1.25.0 1.37.0}"
cd "$ROOT"

[[ -n "${SKIP_SETUP:-}" ]] || VENV="$VENV" bash "$ROOT/deploy/setup.sh"
BIN="$VENV/bin"
export PATH="$BIN:$PATH"

step() { printf '\n==> %s\n' "$*"; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

step "hadolint $(hadolint --version | head -1 | awk '{print $NF}'): Dockerfile"
hadolint --failure-threshold warning Dockerfile
echo "Dockerfile: no findings at warning level or above"

step "docker-compose $(docker-compose version --short) config (no engine needed)"
docker-compose -f docker-compose.yml config --quiet
docker-compose -f docker-compose.yml --profile test config --quiet
docker-compose -f docker-compose.yml --profile test config --services | sort | tr '\n' ' '
echo

kv_args=()
for v in $KUBE_VERSIONS; do kv_args+=(-k "$v"); done

value_sets=("")
for f in "$CHART"/ci/*-values.yaml; do value_sets+=("$f"); done
step "helm $(helm version --short): lint --strict and template, ${#value_sets[@]} value sets"
for values in "${value_sets[@]}"; do
  label="${values:+${values#"$ROOT/"}}"
  label="${label:-default values}"
  args=()
  [[ -n "$values" ]] && args=(--values "$values")
  echo "--- $label"
  helm lint --strict "$CHART" "${args[@]}" >"$work/lint.txt" 2>&1 \
    || { cat "$work/lint.txt"; echo "helm lint failed: $label" >&2; exit 1; }
  grep -E '^\[(WARNING|ERROR)\]' "$work/lint.txt" && { echo "helm lint findings: $label" >&2; exit 1; }
  out="$work/$(basename "${values:-default}" .yaml).rendered.yaml"
  helm template ec-cache "$CHART" --namespace ec-cache "${args[@]}" >"$out"
  "$BIN/python" "$ROOT/deploy/validate_manifests.py" --quiet "${kv_args[@]}" "$out"
done

step "pytest tests/deploy"
# tests/conftest.py belongs to the server suite (needs httpx etc.); the deploy tests
# use no fixtures from it, so they run in the tools venv with --noconftest. The
# server's own venv can run them too: `.venv/bin/python -m pytest tests/deploy`.
# tests/deploy/test_deploy_observability.py starts a real server for its /metrics, with
# the server's venv ($EC_SERVER_PYTHON, default .venv/bin/python: `make test` builds it).
EC_DEPLOY_VENV="$VENV" "$BIN/python" -m pytest -p no:cacheprovider --noconftest -q \
  -o addopts="" "$ROOT/tests/deploy" "$@"

step "all deployment checks passed"
