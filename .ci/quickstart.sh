#!/usr/bin/env bash
# Run the README's quick start, as written, in a fresh clone of HEAD, so that it cannot silently break:
# the commands come from the block between `<!-- quickstart -->` and `<!-- /quickstart -->` in README.md.
#   - `make serve` runs in the background (its own process group); the script waits for /readyz;
#   - every other command runs as written, in the clone, with port 8000 replaced by a free port (in the
#     command, and as PORT for make; so a server already on 8000 neither breaks nor fakes the run) and
#     `curl` given --fail-with-body, so an
#     HTTP error fails the run instead of printing a JSON error and going on;
#   - any command that fails, or a server that is not ready within READY_TIMEOUT_S, fails the script.
# Prints how long `make serve` took from nothing to ready (venv, install, model load).
#
# Usage: .ci/quickstart.sh        (or `make quickstart`); KEEP=1 keeps the clone for a look afterwards.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
READY_TIMEOUT_S=${READY_TIMEOUT_S:-300}
work=$(mktemp -d /tmp/quickstart.XXXXXX)
clone="$work/linformer-serve"
server_pid=

cleanup() {
    local status=$?
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
        kill -TERM -- "-$server_pid" 2>/dev/null || true   # make and the server it started
        for _ in $(seq 1 50); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.2; done
    fi
    if [ "$status" -ne 0 ]; then
        echo "---- make serve log (last 40 lines) ----"
        tail -40 "$work/serve.log" 2>/dev/null || true
    fi
    [ "${KEEP:-0}" = 1 ] && echo "clone kept in $clone" || rm -rf "$work"
    exit "$status"
}
trap cleanup EXIT

# The README's block, one logical command a line (backslash continuations joined), comments dropped.
commands=$(awk '/<!-- quickstart -->/ {on=1; next} /<!-- \/quickstart -->/ {on=0} on' "$repo/README.md" \
    | sed -e '/^```/d' \
    | awk '{ if (sub(/\\$/, "")) { line = line $0 } else { print line $0; line = "" } }' \
    | sed -e 's/[[:space:]]*#[^'"'"'"]*$//' -e 's/[[:space:]]*$//' -e '/^[[:space:]]*#/d' -e '/^[[:space:]]*$/d')
if ! grep -qx 'make serve' <<<"$commands"; then
    echo "quickstart.sh: no 'make serve' line in README.md's quickstart block" >&2
    exit 1
fi

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
git clone --quiet "$repo" "$clone"
cd "$clone"
echo "quickstart: fresh clone of $(git rev-parse --short HEAD) in $clone, port $port"

while IFS= read -r command; do
    command=${command//8000/$port}
    if [ "$command" = "make serve" ]; then
        echo "\$ make serve   (background, PORT=$port)"
        start=$SECONDS
        setsid make serve PORT="$port" >"$work/serve.log" 2>&1 &
        server_pid=$!
        until curl -sf "http://127.0.0.1:$port/readyz" >/dev/null; do
            kill -0 "$server_pid" 2>/dev/null || { echo "make serve exited before it was ready" >&2; exit 1; }
            [ $((SECONDS - start)) -lt "$READY_TIMEOUT_S" ] || { echo "not ready in ${READY_TIMEOUT_S}s" >&2; exit 1; }
            sleep 1
        done
        echo "quickstart: make serve ready after $((SECONDS - start)) s (fresh venv, serving dependencies, models loaded)"
        if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch' 2>/dev/null; then
            echo "make serve installed torch; serving must not need it" >&2
            exit 1
        fi
        continue
    fi
    command=$(sed -E 's/^curl /curl --fail-with-body /' <<<"$command")
    echo "\$ $command"
    start=$SECONDS
    PORT=$port bash -euo pipefail -c "$command"   # the Makefile's PORT, for `make loadtest`
    echo
    echo "quickstart: ok after $((SECONDS - start)) s"
done <<<"$commands"
echo "quickstart: PASS"
