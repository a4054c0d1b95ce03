#!/usr/bin/env bash
# The whole test suite: format, lint, types, then the tests on both builds (docs/development.md,
# "Builds"). Local runs and CI run exactly this.
#   scripts/check.sh                 bounded suite (minutes)
#   scripts/check.sh --slow          also the long load and soak tests
#   scripts/check.sh --pure          the pure build only: a quicker loop while editing
#   scripts/check.sh --quick         the inner loop: pure build, no slow, heavy or property
#                                    tests, on every test directory (docs/testing.md)
#   scripts/check.sh [...] TESTS...  those pytest arguments instead, on each build
# The compiled build (mypyc, scripts/build-compiled.sh) runs every test; the pure build, the
# editable .venv, runs the contract, edge and hardening tests and tests/test_build.py.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
marker=(-m "not slow")
builds=both
quick=
while [ $# -gt 0 ]; do
  case "$1" in
    --slow) marker=(); shift ;;
    --pure) builds=pure; shift ;;
    --quick) builds=pure; quick=1; marker=(-m "not slow and not heavy and not property"); shift ;;
    *) break ;;
  esac
done
t0=$SECONDS
mark() { echo "   ($((SECONDS - t0)) s)"; }

# The wheel's C compile takes a core for a minute or two. It runs beside the linters and
# the pure build's tests at the lowest priority, so that the tests' processes, some of them
# timed, keep the CPU they would have without it; the compiled run waits for it.
if [ "$builds" = both ]; then
  mkdir -p .build
  # Its own process group, so a failing step stops pip and gcc too.
  nice -n 19 setsid scripts/build-compiled.sh >.build/build-compiled.log 2>&1 &
  build_pid=$!
  trap 'kill -- "-$build_pid" 2>/dev/null || true' EXIT
fi
echo "== ruff format --check"; ruff format --check gateway tests bench setup.py
echo "== ruff check"; ruff check gateway tests bench setup.py
echo "== mypy --strict gateway"; mypy
echo "== validate-deploy"; scripts/validate-deploy.sh
# Into .build/ (ignored): a broken link, a lost anchor or a page off the nav fails it.
echo "== mkdocs build --strict"; NO_MKDOCS_2_WARNING=1 mkdocs build --strict -q --site-dir .build/site
mark

pure=("$@")
[ $# -gt 0 ] || pure=(tests/contract tests/edge tests/hardening tests/test_build.py)
[ $# -gt 0 ] || [ -z "$quick" ] || pure=(tests)
echo "== pytest, pure build: ${pure[*]}"
SGLANG_GATEWAY_EXPECT_BUILD=pure pytest -q -p no:cacheprovider "${marker[@]}" "${pure[@]}"
mark
if [ "$builds" = both ]; then
  echo "== compiled build (scripts/build-compiled.sh)"
  if ! wait "$build_pid"; then
    cat .build/build-compiled.log; echo "the compiled build failed" >&2; exit 1
  fi
  grep '^build-compiled:' .build/build-compiled.log
  mark
  echo "== pytest, compiled build: ${*:-all tests}"
  # From a copy of tests/ beside no gateway/ (scripts/build-compiled.sh): only the
  # compiled package can be imported, in every process the tests start. `python -m pytest`
  # because .venv-compiled has no pytest script of its own (its packages come from .venv's
  # site-packages by a .pth); the cwd it puts on sys.path holds tests/ and no gateway/.
  (cd .build/compiled-run && SGLANG_GATEWAY_EXPECT_BUILD=compiled \
    ../../.venv-compiled/bin/python -m pytest -q -p no:cacheprovider "${marker[@]}" "$@")
  mark
fi
