#!/usr/bin/env bash
# The base image of deploy/Dockerfile and of the compose test's Redis where images cannot be
# pulled: Debian bookworm from Debian's packages (debootstrap), imported into Podman.
# Idempotent: nothing to do when the image exists; the root filesystem's tarball is kept in
# CACHE_DIR, so a second machine state (podman storage reset) imports it again in seconds.
#   deploy/podman/base-image.sh [IMAGE]     (default localhost/rlmesh-base:bookworm)
set -euo pipefail
IMAGE=${1:-localhost/rlmesh-base:bookworm}
CACHE_DIR=${RLMESH_COMPOSE_CACHE:-/var/cache/rlmesh-compose}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TARBALL=$CACHE_DIR/rootfs-bookworm.tar

if podman image exists "$IMAGE"; then
  echo "base image $IMAGE is there"
  exit 0
fi
mkdir -p "$CACHE_DIR"
if [ ! -s "$TARBALL" ]; then
  command -v debootstrap >/dev/null || { echo "debootstrap is needed (apt-get install debootstrap)" >&2; exit 1; }
  rootfs=$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  # python3-venv: the Dockerfile's virtual environment; redis-server: the test's Redis (the
  # compose file's redis:7 cannot be pulled here), the same server with its redis-cli.
  echo "debootstrap bookworm into $rootfs (about 2 minutes)"
  debootstrap --variant=minbase --include=python3,python3-venv,redis-server bookworm "$rootfs" "$MIRROR" \
    >"$CACHE_DIR/debootstrap.log" 2>&1 || { tail -20 "$CACHE_DIR/debootstrap.log" >&2; exit 1; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -cf "$TARBALL.partial" . && mv "$TARBALL.partial" "$TARBALL"
fi
podman import --change 'CMD ["/bin/bash"]' "$TARBALL" "$IMAGE" >/dev/null
echo "base image $IMAGE imported from $TARBALL"
