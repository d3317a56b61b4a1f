# Sourced by scripts/setup.sh, demo.sh and test.sh: the Python everything runs with, as $PY, and
# why, as $PY_WHY. The scripts never install into a Python you did not choose for it:
#   $PYTHON when set (you chose it: the scripts install into it);
#   else the active virtual environment ($VIRTUAL_ENV, or the one whose python3 is first on
#   PATH: you chose it; the scripts install into it, and say so);
#   else the clone's own virtual environment .venv, made on first use with
#   `python3 -m venv --system-site-packages .venv` and reused after. It sees what python3 already
#   has (a torch of several GB, a CUDA build: reused, not copied) while everything pip installs
#   lands in .venv only: python3's own packages are never changed.
# It also puts $PY's bin directory first on PATH (the tests' `nanbisect` console script and
# anything that asks for `python3` then get this environment's). Prints nothing; setup.sh says.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  PY_WHY="\$PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  PY=$VIRTUAL_ENV/bin/python
  PY_WHY="the active virtual environment $VIRTUAL_ENV"
elif [ ! -e "$_root/.venv" ] && _venv=$(python3 -c 'import sys
if sys.prefix == sys.base_prefix: sys.exit(1)
print(sys.prefix)' 2>/dev/null); then     # python3 on PATH is a virtual environment's (CI images)
  PY=$_venv/bin/python
  PY_WHY="the virtual environment $_venv, whose python3 is first on PATH"
else
  PY=$_root/.venv/bin/python
  PY_WHY="the clone's virtual environment $_root/.venv"
  if [ -e "$_root/.venv" ] && ! "$PY" -c pass >/dev/null 2>&1; then
    echo "setup: $_root/.venv exists but its Python does not run (made by a Python that has" \
         "since moved?); remove it (rm -rf .venv) and run this again" >&2
    exit 1
  fi
  if [ ! -e "$_root/.venv" ]; then
    _base=$(command -v python3 || true)
    if [ -z "$_base" ]; then
      echo "setup: no python3 on PATH; install Python 3.10 or newer (or pass" \
           "PYTHON=/path/to/python)" >&2
      exit 1
    fi
    echo "setup: making the virtual environment $_root/.venv from $_base" \
         "(--system-site-packages: it reuses what that Python has, e.g. its torch, and" \
         "installs nothing into it)" >&2
    if ! "$_base" -m venv --system-site-packages "$_root/.venv" >&2; then
      rm -rf "$_root/.venv"
      echo "setup: could not make .venv; install the venv module (Debian: apt-get install" \
           "python3-venv), activate a virtual environment, or pass PYTHON=/path/to/a/python" >&2
      exit 1
    fi
  fi
fi
case $PY in
  */*) ;;
  *) PY=$(command -v "$PY" || echo "$PY") ;;   # PYTHON=python3.12: its path, for PATH below
esac
if ! "$PY" -c pass >/dev/null 2>&1; then
  echo "setup: $PY ($PY_WHY) does not run; pass PYTHON=/path/to/a/python (3.10 or newer)" >&2
  exit 1
fi
PATH=$(dirname "$PY"):$PATH
export PY PY_WHY PATH
