#!/usr/bin/env bash
# The test environments that `make test` needs only after its first stages (the SDK at
# its dependency floor, vLLM's classes, the real vLLM engine), built in the background
# at low priority while lint, the deployment checks and the main suite run.
#
#   scripts/venvs.sh start        # start every build in the background (make test does)
#   scripts/venvs.sh ready NAME   # wait for NAME's background build, or build it now
#
# NAME is sdk-floor, vllm or vllm-engine. Each build is its own setup script, which is
# idempotent; its output goes to .venv-logs/NAME.log.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOGS="$ROOT/.venv-logs"
declare -A SCRIPTS=(
    [sdk-floor]="scripts/sdk-floor-venv.sh"
    [vllm]="scripts/setup-vllm-venv.sh"
    [vllm-engine]="scripts/setup-vllm-engine-venv.sh"
)

case "${1:-}" in
start)
    mkdir -p "$LOGS"
    for name in "${!SCRIPTS[@]}"; do
        rm -f "$LOGS/$name.rc"
        # The exit status lands in NAME.rc; `ready` waits for that file.
        (
            cd "$ROOT"
            status=0
            nice -n 19 bash "${SCRIPTS[$name]}" >"$LOGS/$name.log" 2>&1 || status=$?
            echo "$status" >"$LOGS/$name.rc.tmp"
            mv "$LOGS/$name.rc.tmp" "$LOGS/$name.rc"
        ) </dev/null >/dev/null 2>&1 &
        echo "$name" >"$LOGS/$name.started"
        echo "venvs: building $name in the background (.venv-logs/$name.log)"
    done
    ;;
ready)
    name="${2:?usage: $0 ready NAME}"
    [[ -n "${SCRIPTS[$name]:-}" ]] || { echo "venvs: unknown environment $name" >&2; exit 2; }
    if [[ ! -f "$LOGS/$name.started" ]]; then
        exec bash "$ROOT/${SCRIPTS[$name]}"  # nothing started it: build it now
    fi
    waited=0
    until [[ -f "$LOGS/$name.rc" ]]; do
        if (( waited++ >= 3600 )); then
            echo "venvs: $name still building after an hour" >&2
            exit 1
        fi
        sleep 1
    done
    rm -f "$LOGS/$name.started"
    status="$(cat "$LOGS/$name.rc")"
    tail -n 3 "$LOGS/$name.log"
    if [[ "$status" != 0 ]]; then
        cat "$LOGS/$name.log" >&2
        echo "venvs: building $name failed ($status)" >&2
        exit 1
    fi
    ;;
*)
    echo "usage: $0 start | ready NAME" >&2
    exit 2
    ;;
esac
