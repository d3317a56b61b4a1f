"""A Guard whose every write fails: ``RLIMIT_FSIZE`` (tests/bundle/test_atomic.py).

Usage: python guard_file_limit.py OUT BYTES. Limits every file this process writes to BYTES (a
write past it fails with EFBIG; SIGXFSZ, which would kill the process, is ignored), then runs the
NaN batch of fixtures/tasks/nan_batch.py as step 3 under a Guard into OUT, and prints the
`NonFiniteStep` it raised as JSON: {"bundle", "error", "message"}. Both the bundle and its
rescue (under $TMPDIR) are bigger than BYTES."""
import json
import resource
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fixtures" / "tasks"))

import nan_batch  # noqa: E402

from nanbisect import Guard, NonFiniteStep  # noqa: E402

out, limit = Path(sys.argv[1]), int(sys.argv[2])
guard = Guard(nan_batch.task(), entry=str(ROOT / "fixtures/tasks/nan_batch.py") + ":task",
              out=out, start_step=3)
batch = list(zip(range(4), nan_batch.batches()))[3][1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    guard.step(batch)
except NonFiniteStep as e:
    print(json.dumps({"bundle": e.bundle and str(e.bundle), "error": e.error,
                      "message": str(e)}))
    sys.exit(0)
sys.exit(1)
