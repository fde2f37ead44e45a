#!/usr/bin/env bash
# A Docker daemon of our own, for machines where none runs (containers, CI runners without systemd):
#   scripts/docker/dockerd.sh start   # prints the DOCKER_HOST to export once the daemon answers
#   scripts/docker/dockerd.sh stop
# Runs as root with `--iptables=false` (no NAT: containers talk to each other and to the host over the
# bridge, image builds reach the network with the host's network), its images under
# $LORAPLEX_DOCKER_CACHE/data-root (kept between runs, so rebuilds are cached) and its socket, pidfile
# and state under $LORAPLEX_DOCKERD_RUN, so it never touches a system daemon's /var/run/docker*.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cache=${LORAPLEX_DOCKER_CACHE:-$repo/bench/.cache/docker}
run=${LORAPLEX_DOCKERD_RUN:-/tmp/loraplex-dockerd}
sock=$run/docker.sock pidfile=$run/dockerd.pid
export DOCKER_HOST=unix://$sock

answers() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

case ${1:-} in
  start)
    if answers; then echo "DOCKER_HOST=$DOCKER_HOST"; exit 0; fi
    [ "$(id -u)" = 0 ] || { echo "dockerd.sh: the daemon needs root" >&2; exit 3; }
    command -v dockerd >/dev/null 2>&1 || { echo "dockerd.sh: no dockerd (scripts/docker/install-docker.sh)" >&2; exit 3; }
    mkdir -p "$run" "$cache/data-root"
    nohup dockerd --iptables=false --data-root "$cache/data-root" --exec-root "$run/exec" \
      --pidfile "$pidfile" --host "$DOCKER_HOST" >"$run/dockerd.log" 2>&1 &
    for _ in $(seq 1 120); do
      if answers; then echo "DOCKER_HOST=$DOCKER_HOST"; exit 0; fi
      if ! kill -0 $! 2>/dev/null; then break; fi
      sleep 0.5
    done
    echo "dockerd.sh: the daemon did not come up; the end of $run/dockerd.log:" >&2
    tail -n 20 "$run/dockerd.log" >&2
    exit 3
    ;;
  stop)
    [ -s "$pidfile" ] || exit 0
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || exit 0
    for _ in $(seq 1 60); do
      if ! kill -0 "$pid" 2>/dev/null; then
        umount "$run/exec/netns/default" 2>/dev/null || true  # the daemon leaves its netns mount behind
        exit 0
      fi
      sleep 0.5
    done
    echo "dockerd.sh: dockerd $pid still runs after 30 s" >&2
    exit 1
    ;;
  *)
    echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
