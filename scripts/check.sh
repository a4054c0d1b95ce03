#!/usr/bin/env bash
# The whole test suite: format, lint, types, tests. Local runs and CI run exactly this.
#   scripts/check.sh            bounded suite (minutes)
#   scripts/check.sh --slow     also the long load and soak tests
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
marker=(-m "not slow")
if [ "${1:-}" = "--slow" ]; then marker=(); shift; fi
echo "== ruff format --check"; ruff format --check gateway tests
echo "== ruff check"; ruff check gateway tests
echo "== mypy --strict gateway"; mypy
echo "== validate-deploy"; scripts/validate-deploy.sh
echo "== pytest"; python -m pytest -q -p no:cacheprovider "${marker[@]}" "$@"
