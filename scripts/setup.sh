#!/usr/bin/env bash
# Install nanbisect (editable) and what it needs; `setup.sh test` adds the test suite's extras.
# Idempotent. Installs only into the Python scripts/env.sh chose: $PYTHON, the active virtual
# environment, or the clone's own .venv (which sees python3's packages, torch included, but
# changes none of them). Says which, and names every package it installs. torch is installed
# only when none is importable, pinned to 2.13.0: a bare `pip install torch` would download a
# multi-GB CUDA build (where pip's configuration has a local CPU wheel, that one is taken).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
what=.
[ "${1:-}" = test ] && what=".[test]"
echo "setup: installing into $PY ($PY_WHY; Python" \
     "$("$PY" -c 'import sys; print(sys.version.split()[0])'))" >&2
pip_install() {  # pip install ARGS..., its progress shown, then one line naming what it added
  local log
  log=$(mktemp)
  local code=0 added
  "$PY" -m pip install --disable-pip-version-check --progress-bar on "$@" 2>&1 | tee "$log" \
    | { grep -v -E "^(Requirement already satisfied|Obtaining|  Checking|  Preparing|Looking in)" \
        || true; } >&2 || code=$?
  added=$(sed -n 's/^Successfully installed //p' "$log")
  rm -f "$log"
  [ "$code" = 0 ] || return "$code"
  echo "setup: installed ${added:-nothing new (all present)}" >&2
}
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" \
    >/dev/null 2>&1; then
  echo "setup: no torch installed: installing torch==2.13.0 (a large wheel: a minute or two)" >&2
  pip_install "torch==2.13.0"
fi
if "$PY" scripts/setup_satisfied.py "$what" 2>/dev/null; then
  # (pip takes 20 s to say "already satisfied"; a new dependency in pyproject.toml runs it)
  echo "setup: nanbisect -e '$what' and everything pyproject.toml asks for are installed" >&2
else
  echo "setup: installing nanbisect -e '$what' and its missing dependencies" >&2
  pip_install -e "$what"
fi
# A C++ compiler: torch.compile's CPU backend (inductor) builds C++ kernels, and nanbisect
# replays a compiled capture compiled (docs/guide/compiled.md); the test suite's emulated npu
# device (tests/npu) is a C++ extension built once with it. Best effort: with apt and root,
# install g++ when no C++ compiler is present; otherwise say what is missing. Silent when one is.
if ! command -v "${CXX:-g++}" >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: no C++ compiler: installing g++ with apt-get (torch.compile's CPU backend" \
         "and the test suite's emulated npu device need one)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++; } >&2 \
      || echo "setup: apt-get could not install g++; compiled replays on the CPU will fail" \
              "until a C++ compiler is installed (tests that compile or use the emulated npu" \
              "device skip)" >&2
  else
    echo "setup: no C++ compiler (g++) and no root with apt-get to install one: compiled" \
         "replays on the CPU and the test suite's emulated npu device need it (tests that" \
         "compile or use the npu device skip)" >&2
  fi
fi
if [ "$PY" = "$PWD/.venv/bin/python" ]; then
  echo "setup: done; nanbisect is in $PWD/.venv: 'source .venv/bin/activate' puts it on your" \
       "PATH (or call .venv/bin/nanbisect)" >&2
else
  echo "setup: done ($PY)" >&2
fi
