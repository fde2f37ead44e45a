#!/usr/bin/env bash
# Debian's Docker engine, its compose client (docker-compose 1.29) and debootstrap: what
# tests/deploy/test_docker_compose.py (pytest -m docker) and scripts/docker/build-offline.sh need.
# Not part of scripts/setup.sh: the default test run does not use Docker, and a machine without root
# simply skips the docker test.
set -euo pipefail
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
echo "install-docker: ok ($(dockerd --version), $(docker-compose --version), debootstrap $(dpkg-query -W -f='${Version}' debootstrap))"
