"""A fork server for the tests' CLI runs: one process per pytest worker imports torch once, then
forks a child for each ``python -m nanbisect ARGS`` a test asks for.

Each child is a real process: its own pid, working directory, environment, stdout and stderr
(files the caller reads), exit status, and its own ``import nanbisect`` (the server never imports
nanbisect); what it skips is the interpreter's start and ``import torch`` (about 2 s of CPU each
on the CI machine, a few hundred times a suite). The server never runs a torch op before it
forks, so the child starts with no OpenMP pool to inherit (GNU OpenMP's does not survive fork)
and sizes its own. What a child cannot see: environment variables that torch reads when it is
imported (``OMP_NUM_THREADS``, ``ATEN_CPU_CAPABILITY``, ...); `conftest.cli` runs those in a
fresh interpreter instead, as it does any test that asks for one (``fresh=True``).

Protocol (one request at a time, JSON lines on stdin/stdout): ``{"argv", "cwd", "env", "out",
"err"}`` -> ``{"pid": P}`` at once, then ``{"code": C}`` when the child has ended (C < 0: killed
by signal -C, as subprocess reports it).
"""
from __future__ import annotations

import json
import os
import sys


def _child(req: dict) -> None:
    """In the forked child: become ``python -m nanbisect ARGV`` in ``cwd`` with ``env``."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((devnull, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        import tempfile
        tempfile.tempdir = None          # TMPDIR is read again, from this child's environment
        sys.path[0] = os.getcwd()        # what `python -m` puts first
        from nanbisect.multirank.spawn import run_main   # here: each child imports nanbisect

        code = run_main(["-m", "nanbisect", *req["argv"]])
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code & 0xFF if code >= 0 else 1)


def main() -> None:
    import torch  # noqa: F401 - the point of this process
    import torch._dynamo  # noqa: F401 - building an optimizer imports it (1.5 s more)
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401

    reply = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        reply.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        reply.write(json.dumps({"code": code}) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
