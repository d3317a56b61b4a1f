# Sourced by scripts/setup.sh, demo.sh and test.sh: the Python everything runs with, as $PY.
#   $PYTHON when set; else python3 when it is a virtual environment's or accepts `pip install`;
#   else (a system Python that refuses installs, PEP 668: Debian 12's /usr/bin/python3) the
#   clone's own virtual environment .venv, made on first use and reused after.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x "$_root/.venv/bin/python" ]; then
  PY=$_root/.venv/bin/python
else
  _base=$(command -v python3 || true)
  if [ -z "$_base" ]; then
    echo "setup: no python3 on PATH; install Python 3.10 or newer (or pass PYTHON=/path/to/python)" >&2
    exit 1
  fi
  _managed=$("$_base" -c 'import os, sys, sysconfig
inside = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
print("yes" if not inside and os.path.exists(marker) else "no")')
  if [ "$_managed" = yes ]; then
    echo "setup: $_base is the system's Python and refuses pip installs (PEP 668): making a" \
         "virtual environment in $_root/.venv" >&2
    if ! "$_base" -m venv "$_root/.venv"; then
      rm -rf "$_root/.venv"
      echo "setup: could not make .venv; install the venv module (Debian: apt-get install" \
           "python3-venv) or pass PYTHON=/path/to/a/python" >&2
      exit 1
    fi
    PY=$_root/.venv/bin/python
  else
    PY=$_base
  fi
fi
export PY
