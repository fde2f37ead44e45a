#!/usr/bin/env bash
# A Python 3.11 base image without any registry: Debian bookworm from its mirror (debootstrap, minbase
# variant, plus python3, python3-venv and ca-certificates), imported with `docker import`.
#   scripts/docker/debian-base.sh [TAG]        # default loraplex-base:bookworm
# The root filesystem is kept as a tarball in $LORAPLEX_DOCKER_CACHE (bench/.cache/docker), so a second
# machine-local build skips debootstrap (about 3 minutes on 2 cores). DEBIAN_MIRROR overrides the mirror.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
tag=${1:-loraplex-base:bookworm}
cache=${LORAPLEX_DOCKER_CACHE:-$repo/bench/.cache/docker}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
packages=python3,python3-venv,ca-certificates

if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "debian-base: $tag exists"; exit 0
fi
mkdir -p "$cache"
tarball=$cache/bookworm-minbase-$(printf %s "$packages" | sha256sum | cut -c1-12).tar
if [ ! -s "$tarball" ]; then
  command -v debootstrap >/dev/null 2>&1 || { echo "debian-base: no debootstrap (scripts/docker/install-docker.sh)" >&2; exit 3; }
  rootfs=$(mktemp -d "$cache/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs" "$tarball.part"' EXIT
  echo "debian-base: debootstrap bookworm into $rootfs ..."
  debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 \
    || { tail -n 20 "$cache/debootstrap.log" >&2; exit 1; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner -cf "$tarball.part" .
  mv "$tarball.part" "$tarball"
fi
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  "$tarball" "$tag" >/dev/null
echo "debian-base: imported $tag from $tarball"
