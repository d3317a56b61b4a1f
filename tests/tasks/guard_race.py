"""Several of these at once guard the same failing step into one ``out`` (tests/bundle/test_atomic.py).

Usage: python guard_race.py OUT GO_FILE. Waits for GO_FILE to exist, then runs the NaN batch of
fixtures/tasks/nan_batch.py as step 3 and prints the bundle the Guard wrote."""
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fixtures" / "tasks"))

import nan_batch  # noqa: E402

from nanbisect import Guard, NonFiniteStep  # noqa: E402

out, go = Path(sys.argv[1]), Path(sys.argv[2])
guard = Guard(nan_batch.task(), entry=str(ROOT / "fixtures/tasks/nan_batch.py") + ":task",
              out=out, start_step=3)
batch = list(zip(range(4), nan_batch.batches()))[3][1]
(go.parent / f"ready-{os.getpid()}").touch()     # built and about to wait for the gun
while not go.exists():
    time.sleep(0.001)
try:
    guard.step(batch)
except NonFiniteStep as e:
    print(e.bundle)
    sys.exit(0)
sys.exit(1)
