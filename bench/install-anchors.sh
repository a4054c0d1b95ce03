#!/usr/bin/env bash
# Install the benchmark's anchors and tools where the registries allow; never fails the caller
# on a missing registry or permission (each step reports and moves on).
#   nginx, wrk      Debian packages (apt-get; needs root or sudo)
#   sglang-router   PyPI, into bench/.venv-router (its own venv: the gateway's stays clean)
#   py-spy          PyPI, into .venv (only for `bench/run.py --profile`)
# Usage: bench/install-anchors.sh [--no-apt] [--no-router] [--py-spy]
# Exit status 1 when something could not be installed; callers treat that as a note.
set -uo pipefail
cd "$(dirname "$0")/.."
apt=1 router=1 pyspy=0
for arg in "$@"; do
  case "$arg" in
    --no-apt) apt=0 ;;
    --no-router) router=0 ;;
    --py-spy) pyspy=1 ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done
status=0

if [ "$apt" = 1 ]; then
  missing=()
  command -v nginx >/dev/null || missing+=(nginx)
  command -v wrk >/dev/null || missing+=(wrk)
  if [ "${#missing[@]}" -gt 0 ]; then
    sudo=()
    if [ "$(id -u)" != 0 ]; then
      if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo=(sudo -n); fi
    fi
    if ! command -v apt-get >/dev/null; then
      echo "install-anchors: no apt-get: install ${missing[*]} yourself" >&2; status=1
    elif [ "$(id -u)" != 0 ] && [ "${#sudo[@]}" = 0 ]; then
      echo "install-anchors: not root and no passwordless sudo: skipping ${missing[*]}" >&2
      status=1
    else
      echo "install-anchors: apt-get install ${missing[*]}"
      if ! { "${sudo[@]}" apt-get update -qq &&
             DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq \
               --no-install-recommends "${missing[@]}"; }; then
        echo "install-anchors: apt-get failed for ${missing[*]}" >&2; status=1
      fi
    fi
  fi
fi

# The version the original performance measurements used; SGLANG_ROUTER_SPEC=sglang-router takes the newest instead.
spec=${SGLANG_ROUTER_SPEC:-sglang-router==0.3.2}
if [ "$router" = 1 ] && ! bench/.venv-router/bin/python -c 'import sglang_router' 2>/dev/null; then
  echo "install-anchors: pip install $spec into bench/.venv-router"
  pip=(bench/.venv-router/bin/python -m pip install -q --disable-pip-version-check)
  if ! { python3 -m venv bench/.venv-router && { "${pip[@]}" "$spec" || "${pip[@]}" sglang-router; }; }
  then
    echo "install-anchors: sglang-router could not be installed" >&2; status=1
  fi
fi

if [ "$pyspy" = 1 ] && [ -x .venv/bin/python ] && [ ! -x .venv/bin/py-spy ]; then
  echo "install-anchors: pip install py-spy into .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check py-spy || {
    echo "install-anchors: py-spy could not be installed" >&2; status=1; }
fi

exit "$status"
