#!/usr/bin/env bash
# Download, on the host, every wheel the images install, into docker/wheels/ (git-ignored *.whl).
# Needed where a build container cannot reach the package index itself (our dev VMs: the index is
# only reachable through the host's TLS set-up); build with --build-arg PIP_OFFLINE=1 to use them.
#
# Wheels are chosen for the images' platform, not the host's: CPython 3.11 on glibc 2.36 x86_64
# (bookworm, which is both python:3.11-slim and linformer-base:bookworm). Binary wheels only, so a
# missing wheel fails here instead of compiling inside the image.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
WHEELS=${WHEELS:-$here/wheels}
PYTHON=${PYTHON:-python3}
GLIBC_MINOR=${GLIBC_MINOR:-36}

platforms=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
for minor in $(seq 5 "$GLIBC_MINOR"); do
    platforms+=(--platform "manylinux_2_${minor}_x86_64")
done

requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT
{
    "$PYTHON" "$here/requirements.py"                              # Dockerfile
    "$PYTHON" "$here/requirements.py" --no-base --extra loadtest   # Dockerfile.loadtest
} >"$requirements"

mkdir -p "$WHEELS"
"$PYTHON" -m pip download --quiet --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 "${platforms[@]}" \
    --dest "$WHEELS" -r "$requirements"
echo "$(ls "$WHEELS"/*.whl | wc -l) wheels in $WHEELS"
