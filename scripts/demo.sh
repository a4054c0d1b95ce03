#!/usr/bin/env bash
# Start the bundled SGLang-compatible stub on :30000 and the gateway in front of it on :8080.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/sglang-gateway demo "$@"
