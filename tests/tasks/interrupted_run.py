"""A Ctrl-C in the first seconds of a fresh interpreter's first `nanbisect.run`, then a second
run in the same interpreter (a notebook's kernel): ``python interrupted_run.py MODULE`` sends
SIGINT the moment MODULE starts being imported (inside ``import torch``: torch.fx,
torch.distributed.rpc), prints ``interrupted`` (or ``first finished``), then the second run's
culprit op, or ``second failed: ...``."""
import importlib.abc
import os
import signal
import sys
import tempfile

WHERE = sys.argv[1] if len(sys.argv) > 2 else None
BUNDLE = sys.argv[2] if len(sys.argv) > 2 else None


class Trip(importlib.abc.MetaPathFinder):
    """Sends SIGINT to this process when ``WHERE`` starts being imported, once."""

    done = False

    def find_spec(self, name, path, target=None):
        if name == WHERE and not Trip.done:
            Trip.done = True
            os.kill(os.getpid(), signal.SIGINT)
        return None


def main() -> None:
    # as in a terminal or a notebook's kernel: Ctrl-C raises KeyboardInterrupt (a process started
    # in the background by a shell inherits SIGINT ignored, which Python then leaves ignored;
    # or blocked)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    sys.meta_path.insert(0, Trip())
    import nanbisect

    def run():
        return nanbisect.run(BUNDLE, repro=False, remedies=False, out=tempfile.mkdtemp() + "/r")

    try:
        run()
        print("first finished")
    except KeyboardInterrupt:
        print("interrupted")
    try:
        print("second:", run().culprit.op)
    except BaseException as e:  # noqa: BLE001 - what a notebook would see, said
        print("second failed:", type(e).__name__, str(e)[:200])


if __name__ == "__main__":
    main()
