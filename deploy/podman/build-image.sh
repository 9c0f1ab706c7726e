#!/usr/bin/env bash
# rlmesh:latest with Podman where images cannot be pulled and the build should not reach an
# index: the Debian base image (base-image.sh), a wheelhouse in deploy/wheels/ filled on the
# host (torch pinned to the CPU build; the host's pip configuration decides where wheels come
# from), then deploy/Dockerfile with --build-arg WHEELS=offline.
#   deploy/podman/build-image.sh PYTHON [IMAGE]     (make compose-image)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:?usage: build-image.sh PYTHON [IMAGE]}
IMAGE=${2:-rlmesh:latest}
BASE=${RLMESH_BASE_IMAGE:-localhost/rlmesh-base:bookworm}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

t0=$(date +%s)
deploy/podman/base-image.sh "$BASE"
t1=$(date +%s)
# Wheels for exactly this checkout's dependencies (a stale wheelhouse would lack a new one);
# pip takes what its cache already has. async-timeout: redis-py wants it below Python 3.11.3,
# which Debian 12's 3.11.2 is and the host's Python may not be.
rm -f deploy/wheels/*.whl
"$PY" -m pip wheel -q --disable-pip-version-check -w deploy/wheels \
  "torch==$TORCH_VERSION" "setuptools>=69" "async-timeout>=4.0.3" ".[logging]" 2>&1 | grep -v -e "^ " -e "^WARNING: Location" || true
test -n "$(ls deploy/wheels/torch-*.whl 2>/dev/null)" || { echo "no torch wheel in deploy/wheels" >&2; exit 1; }
rm -f deploy/wheels/rlmesh-*.whl   # the image builds rlmesh from the source it copies
t2=$(date +%s)
podman build -q -f deploy/Dockerfile -t "$IMAGE" --build-arg BASE_IMAGE="$BASE" \
  --build-arg WHEELS=offline --build-arg TORCH_VERSION="$TORCH_VERSION" . >/dev/null
t3=$(date +%s)
echo "image $IMAGE built: base image $((t1 - t0)) s, wheels $((t2 - t1)) s, podman build $((t3 - t2)) s"
