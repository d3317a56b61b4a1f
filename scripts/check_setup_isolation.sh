#!/usr/bin/env bash
# The README's set-up leaves the user's Python as it was: clones this checkout's committed HEAD
# into a new directory, takes `python3 -m pip freeze` (and the site-packages listing), runs the
# clone's `scripts/setup.sh test` (a fresh .venv), then again (.venv exists), then
# `scripts/demo.sh`, each timed, and compares python3's freeze and site-packages before and
# after. Also shows which nanbisect the clone's .venv imports. Exits 1 when python3 changed.
#   bash scripts/check_setup_isolation.sh [WORK_DIR]      (default: a new mktemp -d)
# Runs with PYTHON, VIRTUAL_ENV and PYTHONPATH unset, as a new user's shell would be.
set -uo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
mkdir -p "$work"
clone=$work/clone
git clone -q "$src" "$clone" || exit 2
unset PYTHON VIRTUAL_ENV PYTHONPATH
base=$(command -v python3)
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -m pip freeze --all > "$work/freeze-before.txt" 2>/dev/null
ls -la --time-style=+%s "$site" | grep -v -E " (\.|\.\.|__pycache__)$" \
  > "$work/site-before.txt"
echo "python3: $base ($(python3 -c 'import sys; print(sys.executable, sys.version.split()[0])'))"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
timed() {  # label, command...: runs it in the clone, prints its wall time and exit code
  local label=$1; shift
  local t0 t1 code
  t0=$(date +%s.%N)
  (cd "$clone" && "$@") > "$work/$label.log" 2>&1
  code=$?
  t1=$(date +%s.%N)
  printf '%-28s exit %s  %6.1f s  (load %s)\n' "$label" "$code" "$(echo "$t1 - $t0" | bc)" \
    "$(cut -d' ' -f1 /proc/loadavg)"
}
timed setup-test-fresh-venv bash scripts/setup.sh test
timed setup-test-existing-venv bash scripts/setup.sh test
timed demo bash scripts/demo.sh
python3 -m pip freeze --all > "$work/freeze-after.txt" 2>/dev/null
ls -la --time-style=+%s "$site" | grep -v -E " (\.|\.\.|__pycache__)$" \
  > "$work/site-after.txt"
echo "setup's own lines (fresh .venv):"
grep -E "^setup:" "$work/setup-test-fresh-venv.log" | sed 's/^/  /'
echo "the clone's .venv imports nanbisect from:" \
  "$(cd / && "$clone/.venv/bin/python" -c 'import nanbisect; print(nanbisect.__file__)')"
echo ".venv: $(du -sh "$clone/.venv" | cut -f1)"
fail=0
if diff "$work/freeze-before.txt" "$work/freeze-after.txt"; then
  echo "python3 -m pip freeze --all: unchanged ($(wc -l < "$work/freeze-after.txt") lines)"
else
  echo "python3 -m pip freeze --all: CHANGED"; fail=1
fi
if diff "$work/site-before.txt" "$work/site-after.txt" >/dev/null; then
  echo "$site: unchanged (names, sizes, times)"
else
  echo "$site: CHANGED"; diff "$work/site-before.txt" "$work/site-after.txt" | head; fail=1
fi
echo "logs in $work"
exit $fail
