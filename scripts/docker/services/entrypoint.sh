#!/bin/sh
# redis-server runs as the redis user and, like the official image, with protected mode off when no config
# file is given (the compose network is private; without this Redis refuses every non-loopback client).
# Anything else (nginx) runs as given.
set -e
if [ "$1" = "redis-server" ]; then
  shift
  case "${1:-}" in
    *.conf) exec setpriv --reuid=redis --regid=redis --init-groups redis-server "$@" ;;
    *) exec setpriv --reuid=redis --regid=redis --init-groups redis-server --protected-mode no "$@" ;;
  esac
fi
exec "$@"
