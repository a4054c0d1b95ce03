#!/usr/bin/env bash
# Fuzz the request inspection (gateway.contract: inspection, policy) against the SGLang model.
#   scripts/fuzz.sh [seconds]      default 600
# Invariants: inspect_body never raises, and never forwards a body that SGLang would run with
# the sampling mask on and an unbounded top_k. Uses atheris (libFuzzer) when it installs;
# otherwise a hypothesis run of the same length. Crashing inputs are left in .fuzz/.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev scripts/bootstrap.sh
secs=${1:-600}
mkdir -p .fuzz/corpus
if .venv/bin/python -c 'import atheris' 2>/dev/null \
   || .venv/bin/python -m pip install -q --disable-pip-version-check atheris; then
  .venv/bin/python -m tests.hardening.fuzz_inspection --seeds .fuzz/seeds
  echo "== atheris for ${secs}s"
  exec .venv/bin/python -m tests.hardening.fuzz_inspection \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
    -dict=tests/hardening/fuzz.dict -artifact_prefix=.fuzz/ .fuzz/corpus .fuzz/seeds
fi
echo "== atheris unavailable: hypothesis for ${secs}s"
exec .venv/bin/python -m tests.hardening.fuzz_inspection --hypothesis "$secs"
