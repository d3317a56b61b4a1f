"""A capture that stops half-way, so a test can kill -9 it mid-write (tests/bundle/test_leftovers.py).

Usage: python capture_killed.py OUT READY_FILE. The capture writes its first tensor file, then
touches READY_FILE and waits (the wait replaces the file's checksum, which comes next); the
test then kills the process with SIGKILL, as the OOM killer or a job scheduler would."""
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fixtures" / "tasks"))
sys.path.insert(1, str(ROOT))     # this checkout's nanbisect, not whichever is installed

import nan_batch  # noqa: E402

import nanbisect  # noqa: E402
from nanbisect.bundle import writer  # noqa: E402

out, ready = Path(sys.argv[1]), Path(sys.argv[2])


def stuck(path):
    ready.touch()
    time.sleep(3600)


writer._sha256 = stuck
nanbisect.capture(nan_batch.task(), next(nan_batch.batches()), out / "step000001",
                  entry=str(ROOT / "fixtures/tasks/nan_batch.py") + ":task")
