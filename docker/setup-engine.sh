#!/usr/bin/env bash
# Install and start a Docker engine on a machine where none runs (our dev VMs: no systemd, no
# registry). Safe to run again: it installs only what is missing and starts dockerd only if the
# socket does not answer.
#
# vfs is the storage driver because overlayfs is not available inside these VMs; it copies every
# layer in full, so images take more disk than usual, but it works everywhere.
set -euo pipefail

DOCKERD_LOG=${DOCKERD_LOG:-/tmp/dockerd.log}
STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}

if [ "$(id -u)" -ne 0 ]; then
    echo "setup-engine.sh: run as root (it installs packages and starts dockerd)" >&2
    exit 1
fi

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
# debootstrap is what build-base.sh uses to make a base image without a registry.
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

if docker info >/dev/null 2>&1; then
    echo "dockerd already answers"
else
    echo "starting dockerd (storage driver $STORAGE_DRIVER, log $DOCKERD_LOG)"
    nohup dockerd --storage-driver="$STORAGE_DRIVER" >"$DOCKERD_LOG" 2>&1 &
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    if ! docker info >/dev/null 2>&1; then
        echo "dockerd did not come up within 60 s; last lines of $DOCKERD_LOG:" >&2
        tail -20 "$DOCKERD_LOG" >&2
        exit 1
    fi
fi

docker version --format 'engine {{.Server.Version}}'
docker-compose version --short | sed 's/^/docker-compose /'
# The v2 plugin (`docker compose`) is not packaged in bookworm; say whether it is here.
if docker compose version >/dev/null 2>&1; then
    docker compose version
fi
