#!/usr/bin/env bash
# Build a local Debian bookworm base image with python3, for machines that cannot pull from a
# container registry (our dev VMs reach only the Debian and PyPI mirrors). The Dockerfiles default
# to the public python:3.11-slim; pass --build-arg BASE_IMAGE=linformer-base:bookworm to use this.
#
# bookworm's python3 is 3.11, the same minor version as python:3.11-slim, so wheels built for one
# install on the other.
#
# Usage: docker/build-base.sh [--force]     (skips the work when the image already exists)
set -euo pipefail

IMAGE=${BASE_IMAGE_TAG:-linformer-base:bookworm}
SUITE=bookworm
here=$(cd "$(dirname "$0")" && pwd)
ROOTFS=${ROOTFS:-$here/base/rootfs}    # docker/base/ is git-ignored

if [ "${1:-}" != "--force" ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "$IMAGE already exists (pass --force to rebuild)"
    exit 0
fi

# Use the Debian mirror apt already uses on this machine rather than naming a host here.
debian_mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
    local url
    # deb822 files (URIs: ...) and one-line files (deb URL suite ...): first URL ending in /debian.
    url=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
              2>/dev/null \
          | sed -n -E 's#^(URIs:|deb)[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+/debian)/?([[:space:]].*)?$#\3#p' \
          | head -1)
    if [ -z "$url" ]; then
        echo "build-base.sh: no Debian mirror in /etc/apt/sources.list*; set DEBIAN_MIRROR" >&2
        exit 1
    fi
    echo "$url"
}
MIRROR=$(debian_mirror)

command -v debootstrap >/dev/null || { echo "install debootstrap (docker/setup-engine.sh does)" >&2; exit 1; }

echo "debootstrap $SUITE from $MIRROR into $ROOTFS"
rm -rf "$ROOTFS"
mkdir -p "$ROOTFS"
debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    "$SUITE" "$ROOTFS" "$MIRROR"

# Keep the image small and free of host state: no apt lists or package cache, no host resolver.
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/tmp/* "$ROOTFS"/var/tmp/*
: >"$ROOTFS/etc/resolv.conf"
: >"$ROOTFS/etc/hostname"

echo "importing as $IMAGE"
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase $SUITE + python3 (docker/build-base.sh)" \
    - "$IMAGE"

# The rootfs is only an intermediate; the image holds everything now.
rm -rf "$ROOTFS"
docker run --rm "$IMAGE" python3 -c 'import sys, venv, ensurepip; print("python", sys.version.split()[0])'
