#!/usr/bin/env bash
# End-to-end check of compose.yaml: build the images, start both deployments behind the balancer, wait until they
# answer, classify and translate one text on each, tear everything down. Exits non-zero on any
# failure and records the run in docker/smoke-result.md.
#
# What each deployment must answer follows from the bundles present under models/:
#   bundle dir present -> /classify or /translate must be 200 with a JSON answer
#   bundle dir absent  -> that endpoint must be 503 (and /readyz 503 if the deployment has none)
#
# Uses the local base image (docker/build-base.sh) and host-fetched wheels when that image exists,
# since our dev VMs cannot pull python:3.11-slim. Set BASE_IMAGE to override.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
RESULT=${RESULT:-docker/smoke-result.md}
PROJECT=${PROJECT:-linformer-smoke}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-300}
CLASSIFY_TEXT="A wonderful film: moving story, superb acting, and I would gladly watch it again."
TRANSLATE_TEXT="The document is saved automatically every ten minutes."

if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
else
    compose=(docker-compose)
fi
compose_version="${compose[*]} $("${compose[@]}" version --short 2>/dev/null || true)"
compose+=(-p "$PROJECT" -f compose.yaml)

if [ -z "${BASE_IMAGE:-}" ] && docker image inspect linformer-base:bookworm >/dev/null 2>&1; then
    export BASE_IMAGE=linformer-base:bookworm PIP_OFFLINE=1
fi
export BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim} PIP_OFFLINE=${PIP_OFFLINE:-0}
# An offline build sees only docker/wheels/: top it up, since pyproject.toml's dependencies move.
[ "$PIP_OFFLINE" = 1 ] && docker/fetch-wheels.sh

# ---- the record: everything worth keeping goes through note() into the result file
record=$(mktemp)
note() { printf '%s\n' "$*" | tee -a "$record"; }
failures=0
absent=()
fail() { note "- FAIL: $*"; failures=$((failures + 1)); }

finish() {
    local status=$?
    if [ "$failures" -gt 0 ] || [ "$status" -ne 0 ]; then
        verdict=FAIL
        echo "---- container logs (last 40 lines each) ----"
        "${compose[@]}" logs --no-color --tail 40 2>&1 || true
    elif [ ${#absent[@]} -gt 0 ]; then
        verdict="PASS with bundles absent (${absent[*]}): their 503 paths were checked, not inference"
    else
        verdict=PASS
    fi
    "${compose[@]}" down --remove-orphans --timeout 40 >/dev/null 2>&1 || true
    {
        echo "# docker/smoke.sh: $verdict"
        echo
        cat "$record"
        echo
        echo "**Result: $verdict** ($failures failed checks, exit status $status before teardown)"
    } >"$RESULT"
    rm -f "$record"
    echo "smoke test: $verdict (record in $RESULT)"
    [ "$verdict" != FAIL ]
}
trap finish EXIT

note "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
note "- commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- service docker models 2>/dev/null || echo ' (+ uncommitted changes)')"
note "- host: $(uname -sr), $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
note "- engine: $(docker version --format '{{.Server.Version}}') (storage driver $(docker info --format '{{.Driver}}'))"
note "- compose: $compose_version"
note "- base image: $BASE_IMAGE (PIP_OFFLINE=$PIP_OFFLINE)"
note '- command: `docker/smoke.sh`'

[ -f service/__main__.py ] || { fail "service/__main__.py missing"; exit 1; }
mkdir -p models   # COPY models/ needs the folder even when no bundle is there yet
for bundle in classify-linformer classify-transformer translate-linformer translate-transformer; do
    [ -d "models/$bundle" ] || absent+=("$bundle")
done

for port in 8000 8001; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        fail "host port $port is already in use; stop whatever listens there first"
        exit 1
    fi
done

echo "==== build"
"${compose[@]}" build linformer transformer balancer
note "- image: linformer-serve:cpu $(docker image inspect linformer-serve:cpu --format '{{.Id}}' | cut -c8-19), $(docker image inspect linformer-serve:cpu --format '{{.Size}}' | awk '{printf "%.0f MB", $1/1e6}')"

echo "==== up"
"${compose[@]}" up -d linformer transformer balancer

# http_call METHOD URL [JSON] -> sets $code and $body
http_call() {
    local out
    out=$(mktemp)
    if [ $# -ge 3 ]; then
        code=$(curl -s -o "$out" -w '%{http_code}' -X "$1" -H 'Content-Type: application/json' -d "$3" \
               --max-time 120 "$2" || true)
    else
        code=$(curl -s -o "$out" -w '%{http_code}' --max-time 10 "$2" || true)
    fi
    body=$(cat "$out")
    rm -f "$out"
}

pretty() { python3 -m json.tool --compact 2>/dev/null <<<"$1" || printf '%s\n' "$1"; }

# expect DEPLOYMENT ENDPOINT EXPECTED_CODE CODE BODY
expect() {
    local answer
    answer=$(pretty "$5" | cut -c1-600)
    if [ "$4" = "$3" ]; then
        note "- ok: $1 $2 -> $4 \`$answer\`"
    else
        fail "$1 $2 -> $4, expected $3: \`$answer\`"
    fi
}

note
note "## Checks"
check_deployment() {
    local name=$1 port=$2 classify_bundle=$3 translate_bundle=$4
    local url="http://127.0.0.1:$port" container expect_ready=503 deadline health
    [ -d "models/$classify_bundle" ] || [ -d "models/$translate_bundle" ] && expect_ready=200
    container=$("${compose[@]}" ps -q "$name")

    # Through the balancer: 503 until a replica passes its /readyz check (the replica itself accepts
    # connections only once the lifespan has loaded or rejected the bundles), so wait for the answer
    # the bundles call for, up to the deadline.
    deadline=$((SECONDS + READY_TIMEOUT_S))
    code=000
    while [ "$code" != "$expect_ready" ] && [ $SECONDS -lt $deadline ]; do
        if [ "$(docker inspect -f '{{.State.Running}}' "$container")" != true ]; then
            fail "$name exited before answering (exit code $(docker inspect -f '{{.State.ExitCode}}' "$container"))"
            return
        fi
        sleep 2
        http_call GET "$url/readyz"
    done
    expect "$name" "GET /readyz" "$expect_ready" "$code" "$body"
    [ "$code" = 000 ] && return

    # The image's HEALTHCHECK must agree with /readyz.
    if [ "$expect_ready" = 200 ]; then
        while health=$(docker inspect -f '{{.State.Health.Status}}' "$container"); [ "$health" = starting ] \
              && [ $SECONDS -lt $deadline ]; do
            sleep 2
        done
        [ "$health" = healthy ] && note "- ok: $name HEALTHCHECK -> healthy" \
            || fail "$name HEALTHCHECK -> $health"
    fi

    http_call GET "$url/v1/models"
    note "- info: $name GET /v1/models -> $code \`$(pretty "$body" | cut -c1-600)\`"

    local expected=503
    [ -d "models/$classify_bundle" ] && expected=200
    http_call POST "$url/classify" "{\"text\": \"$CLASSIFY_TEXT\"}"
    expect "$name" "POST /classify ($classify_bundle)" "$expected" "$code" "$body"

    expected=503
    [ -d "models/$translate_bundle" ] && expected=200
    http_call POST "$url/translate" "{\"text\": \"$TRANSLATE_TEXT\"}"
    expect "$name" "POST /translate ($translate_bundle)" "$expected" "$code" "$body"
}

check_deployment linformer 8000 classify-linformer translate-linformer
check_deployment transformer 8001 classify-transformer translate-transformer

note
note "## Bundles"
for bundle in classify-linformer classify-transformer translate-linformer translate-transformer; do
    if [ -d "models/$bundle" ]; then note "- models/$bundle: present"; else note "- models/$bundle: absent (503 expected)"; fi
done
