#!/usr/bin/env bash
# Set up a fresh machine: Debian packages the tests need, a Python 3.11 virtualenv, pinned dependencies.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
  echo "setup: Python 3.11 is required (found $("$PY" --version 2>&1))" >&2; exit 1; }

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
# the native CPU ops (kernels/native_cpu.py) compile with g++ through ninja
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  rm -f .venv/.installed-*
  touch "$stamp"
fi
# Build the native CPU ops now (~10 s, once per machine and source) rather than in the first request.
.venv/bin/python -m kernels.native_cpu || echo "setup: the native CPU ops did not build; the CPU runs the torch path" >&2
echo "setup: ok (.venv ready, redis-server, chromium, g++ and ninja installed)"
