#!/usr/bin/env bash
# Install nanbisect (editable) and everything it needs into the current python3. Idempotent.
# torch is installed only when none is present, pinned to 2.13.0: on this machine type that is the
# CPU wheel lying on disk, while a bare `pip install torch` would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: no torch found, installing torch==2.13.0" >&2
  "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
