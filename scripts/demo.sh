#!/usr/bin/env bash
# Set up (nanbisect and what it needs, not the test extras), then bisect the shipped forward-NaN
# bundle and show its culprit. Exits 0 when nanbisect names a culprit (its own exit code 1).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
source scripts/env.sh
echo "demo: nanbisect run fixtures/bundles/forward_nan_behind_mask" >&2
"$PY" -m nanbisect run fixtures/bundles/forward_nan_behind_mask
code=$?
if [ "$code" -ne 1 ]; then
  echo "demo: expected a culprit (exit 1), nanbisect exited $code" >&2
  exit 1
fi
echo
cat fixtures/bundles/forward_nan_behind_mask/nanbisect-report/report.md
