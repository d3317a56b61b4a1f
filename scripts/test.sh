#!/usr/bin/env bash
# Set up with the test extras, then run the test suite (CPU only, three pytest workers on 2 cores).
#   bash scripts/test.sh           the full suite (what CI runs), the tests' emulated npu device
#                                  built first (tests/npu/README.md)
#   bash scripts/test.sh --fast    the fast tier: no test marked slow (torchrun jobs, triage nights,
#                                  the integrations, ...), for the inner loop
# Other arguments go to pytest (e.g. a test file, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [ "${1:-}" = --fast ]; then
  shift
  tier=(-m "not slow")
fi
bash scripts/setup.sh test
source scripts/env.sh
# Headless Chromium for the browser test of report.html (tests/report/test_html.py): installed with
# apt-get when missing, as root or through password-less sudo (Debian's `chromium`; Ubuntu's
# `chromium-browser` where that is a real package). Without one the test is skipped, except
# under CI=1 or NANBISECT_REQUIRE_BROWSER=1, where it fails: CI must run it.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1; then
  as_root=()
  [ "$(id -u)" = 0 ] || { sudo -n true 2>/dev/null && as_root=(sudo -n); } || as_root=(none)
  if [ "${as_root[*]}" != none ]; then
    echo "test: installing chromium with apt-get (for the report.html browser test)" >&2
    { "${as_root[@]}" apt-get update -qq \
        && { DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq chromium \
             || DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq chromium-browser; }
    } >/dev/null 2>&1 || echo "test: chromium could not be installed" >&2
  fi
fi
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  echo "test: no headless Chromium: the report.html browser test is skipped (it fails under" \
       "CI=1 or NANBISECT_REQUIRE_BROWSER=1)" >&2
fi
# The test suite's emulated npu device (tests/npu/README.md: a C++ extension, built once per torch
# version and source, cached under ~/.cache/nanbisect/npu or $NANBISECT_NPU_CACHE): the full tier
# builds it here, before pytest, so no test waits on the compiler. Without a C++ compiler its
# tests are skipped (scripts/setup.sh installs g++ where it can), except under CI=1 or
# NANBISECT_REQUIRE_NPU=1, where this fails: CI must run them. Any other build error fails here,
# once, rather than in every test that uses the device. The --fast tier has none of those tests.
if [ ${#tier[@]} = 0 ]; then
  npu_required=0
  case "$(printf %s "${CI:-}" | tr '[:upper:]' '[:lower:]')" in
    ""|0|false) ;;
    *) npu_required=1 ;;
  esac
  [ "${NANBISECT_REQUIRE_NPU:-}" = 1 ] && npu_required=1
  npu_log=$(mktemp)
  if PYTHONPATH="$PWD/tests/npu${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m torch_npu >"$npu_log" 2>&1
  then
    echo "test: the $(grep '^emulated npu device: ' "$npu_log" | tail -n 1)" >&2
  elif grep -q NoCompiler "$npu_log"; then
    if [ "$npu_required" = 1 ]; then
      echo "test: no C++ compiler to build the emulated npu device, which CI=1 or" \
           "NANBISECT_REQUIRE_NPU=1 requires: install g++ (scripts/setup.sh does, as root)" >&2
      rm -f "$npu_log"
      exit 1
    fi
    echo "test: no C++ compiler to build the emulated npu device: its tests are skipped (they" \
         "fail under CI=1 or NANBISECT_REQUIRE_NPU=1)" >&2
  else
    echo "test: building the emulated npu device failed ($PY -m torch_npu," \
         "PYTHONPATH=tests/npu):" >&2
    tail -n 40 "$npu_log" >&2
    rm -f "$npu_log"
    exit 1
  fi
  rm -f "$npu_log"
fi
# three workers on two cores: much of the suite waits (subprocesses, time-outs, killed ranks),
# and its multi-rank and triage tests are made to hold under that load. --dist loadgroup: tests
# of one xdist_group mark (those reading one shared expensive run, e.g. tests/cli/test_cli_fixtures.py)
# go to one worker, so that run is done once; those groups go out first, then the tests marked
# slow (tests/conftest.py orders them first), then the rest. A line per test file as it ends
# (tests/helpers/progress.py), the 15 slowest tests at the end. (Not in pyproject's addopts: pytest
# without pytest-xdist would refuse --dist.) pytest-benchmark, when some other package brought it,
# has nothing to measure here: off.
echo "test: $PY -m pytest -q -n 3 --dist loadgroup --durations=15 ${tier[*]:+-m 'not slow'} $*" >&2
exec "$PY" -m pytest -q -n 3 --dist loadgroup --durations=15 -p no:benchmark "${tier[@]}" "$@"
