#!/usr/bin/env bash
# Set up with the test extras, then run the test suite (CPU only, three pytest workers on 2 cores).
#   bash scripts/test.sh           the full suite (what CI runs)
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
# Headless Chromium for the browser checks of report.html (best effort: without it those tests
# are skipped, and say so).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "test: installing chromium with apt-get (for the report.html browser tests)" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
    >/dev/null 2>&1 || echo "test: chromium could not be installed; the browser tests will be skipped" >&2
fi
# three workers on two cores: much of the suite waits (subprocesses, time-outs, killed ranks),
# and its multi-rank and triage tests are made to hold under that load. --dist loadgroup: tests
# of one xdist_group mark (those reading one shared expensive run, e.g. tests/test_cli_fixtures.py)
# go to one worker, so that run is done once; those groups go out first, then the tests marked
# slow (tests/conftest.py orders them first), then the rest. A line per test file as it ends
# (tests/progress.py), the 15 slowest tests at the end. (Not in pyproject's addopts: pytest
# without pytest-xdist would refuse --dist.) pytest-benchmark, when some other package brought it,
# has nothing to measure here: off.
echo "test: $PY -m pytest -q -n 3 --dist loadgroup --durations=15 ${tier[*]:+-m 'not slow'} $*" >&2
exec "$PY" -m pytest -q -n 3 --dist loadgroup --durations=15 -p no:benchmark "${tier[@]}" "$@"
