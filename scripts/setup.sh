#!/usr/bin/env bash
# Install nanbisect (editable) and what it needs; `setup.sh test` adds the test suite's extras.
# Idempotent. The Python is scripts/env.sh's choice: python3, or the clone's own .venv when the
# system Python refuses pip installs (PEP 668). torch is installed only when none is present,
# pinned to 2.13.0: on this machine type that is the CPU wheel lying on disk, while a bare
# `pip install torch` would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
what=.
[ "${1:-}" = test ] && what=".[test]"
echo "setup: using $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))" >&2
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: no torch found: installing torch==2.13.0 (a large wheel: a minute or two)" >&2
  "$PY" -m pip install --disable-pip-version-check --progress-bar on "torch==2.13.0"
fi
echo "setup: installing nanbisect -e '$what' and its dependencies" >&2
"$PY" -m pip install --disable-pip-version-check --progress-bar on -e "$what" \
  | { grep -v -E "^(Requirement already satisfied|Obtaining|  Checking|  Preparing|Looking in)" || true; }
# A C++ compiler: torch.compile's CPU backend (inductor) builds C++ kernels, and nanbisect
# replays a compiled capture compiled (README "NaN only when compiled"). Best effort: with apt
# and root, install g++ when no C++ compiler is present; otherwise say what is missing.
if ! command -v "${CXX:-g++}" >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: no C++ compiler: installing g++ with apt-get (torch.compile's CPU backend" \
         "needs one)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++; } >&2 \
      || echo "setup: apt-get could not install g++; compiled replays on the CPU will fail" \
              "until a C++ compiler is installed (tests that compile skip)" >&2
  else
    echo "setup: no C++ compiler (g++) and no root with apt-get to install one: compiled" \
         "replays on the CPU need it (tests that compile skip)" >&2
  fi
fi
if [ "$PY" != "${PYTHON:-}" ] && [ "$(dirname "$PY")" = "$PWD/.venv/bin" ]; then
  echo "setup: done; nanbisect is installed in $PWD/.venv: run 'source .venv/bin/activate' to" \
       "use it (or call .venv/bin/nanbisect)" >&2
else
  echo "setup: done ($PY)" >&2
fi
