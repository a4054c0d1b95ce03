#!/usr/bin/env bash
# Create (or reuse) .venv and install the project into it. Needs only python3 >= 3.11 and
# access to PyPI. EXTRAS=dev installs the test and lint tools too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "python >= 3.11 is required (found $("$PY" --version 2>&1))" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.installed-${EXTRAS:-base}"
fresh() { [ -f "$1" ] && [ ! pyproject.toml -nt "$1" ]; }
# A dev install includes the base one.
if ! { fresh "$stamp" || { [ -z "${EXTRAS:-}" ] && fresh .venv/.installed-dev; }; }; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -U pip
  spec="."
  [ -n "${EXTRAS:-}" ] && spec=".[${EXTRAS}]"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec"
  touch "$stamp"
fi
# scripts/validate-deploy.sh also needs kubectl and helm, which are no Python packages;
# this puts pinned ones in .venv/bin (and does nothing once they are there).
case ",${EXTRAS:-}," in
  *,dev,* | *,deploy,*) scripts/install-k8s-tools.sh ;;
esac
