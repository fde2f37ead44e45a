#!/usr/bin/env bash
# Build docker-compose.yml's images where Debian's mirror and PyPI are reachable but no image registry:
#   scripts/docker/build-offline.sh [ENV_FILE]      # ENV_FILE default: $LORAPLEX_DOCKER_CACHE/offline.env
# 1. loraplex-base:bookworm, a debootstrapped Debian with python3.11 (scripts/docker/debian-base.sh);
# 2. loraplex-services:bookworm, Debian's redis-server and nginx on it (scripts/docker/services/), the
#    stand-in for redis:7-alpine and nginx:1.27-alpine;
# 3. loraplex:latest by `docker-compose build` on that base, with the torch wheel that pip finds on this
#    machine (pip download torch==PIN: a local +cpu wheel where there is one) in scripts/docker/wheels/ and
#    this machine's extra CA certificates in scripts/docker/ca-certificates/; the rest from PyPI.
# and writes ENV_FILE with the compose variables that select those images. Then, e.g.:
#   export LORAPLEX_WORKER_SECRET=$(openssl rand -hex 32) LORAPLEX_MODEL_DIR=/path/to/hf-model LORAPLEX_OTLP_ENDPOINT=
#   docker-compose --env-file ENV_FILE -p loraplex --profile cpu up -d redis gateway-1 gateway-2 \
#     worker-1-cpu worker-2-cpu load-balancer
# Needs a Docker daemon (DOCKER_HOST; scripts/docker/dockerd.sh starts one) and docker-compose. Builds run
# with the host's network: a daemon started with --iptables=false gives containers no NAT.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
cache=${LORAPLEX_DOCKER_CACHE:-$repo/bench/.cache/docker}
envfile=${1:-$cache/offline.env}
base=loraplex-base:bookworm
services=loraplex-services:bookworm
mkdir -p "$cache" "$(dirname "$envfile")"

scripts/docker/debian-base.sh "$base"

if ! docker image inspect "$services" >/dev/null 2>&1; then
  echo "build-offline: building $services ..."
  DOCKER_BUILDKIT=0 docker build -q --network host --build-arg BASE_IMAGE="$base" -t "$services" \
    scripts/docker/services >/dev/null
fi

pin=$(sed -n 's/^ *"torch==\([^"]*\)",*$/\1/p' pyproject.toml)
[ -n "$pin" ] || { echo "build-offline: no torch==VERSION pin in pyproject.toml" >&2; exit 1; }
if ! ls scripts/docker/wheels/torch-"$pin"[+-]*.whl >/dev/null 2>&1; then
  pip=${PIP:-$repo/.venv/bin/pip}
  [ -x "$pip" ] || pip="python3 -m pip"
  $pip download -q "torch==$pin" --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
    -d scripts/docker/wheels
fi
wheel=$(ls scripts/docker/wheels/torch-"$pin"[+-]*.whl | head -n 1)
case $wheel in
  *+cpu*) ;;
  *) echo "build-offline: warning: $wheel is not a +cpu build (the image will carry CUDA)" >&2 ;;
esac
for crt in /usr/local/share/ca-certificates/*.crt; do
  [ -f "$crt" ] && cp -u "$crt" scripts/docker/ca-certificates/
done

cat >"$envfile" <<ENV
# Written by scripts/docker/build-offline.sh: docker-compose --env-file $envfile ...
LORAPLEX_BASE_IMAGE=$base
LORAPLEX_BUILD_NETWORK=host
LORAPLEX_REDIS_IMAGE=$services
LORAPLEX_NGINX_IMAGE=$services
ENV

echo "build-offline: building loraplex:latest on $base with $(basename "$wheel") ..."
# The build reads no secret and mounts no model: placeholders satisfy the file's required variables.
LORAPLEX_WORKER_SECRET=${LORAPLEX_WORKER_SECRET:-unused-by-the-build} \
LORAPLEX_MODEL_DIR=${LORAPLEX_MODEL_DIR:-/nonexistent} \
  docker-compose --env-file "$envfile" build -q gateway-1
# Earlier builds of loraplex:latest, untagged now (each rebuild of the dependency layer leaves ~2 GB).
docker image prune -f --filter label=org.opencontainers.image.title=loraplex >/dev/null
echo "build-offline: ok (images $base, $services, loraplex:latest; compose variables in $envfile)"
