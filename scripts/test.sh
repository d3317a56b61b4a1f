#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU only, a few minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q "$@"
