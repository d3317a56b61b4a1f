"""Tasks whose loss function takes the replaying process down, one way each (for triage's fault
tests): a segfault, os.abort, a SIGKILL as the out-of-memory killer sends, a hang, an exit without
a report, a Python exception; and `fine`, the same tiny step without a fault (a cheap clean
bundle). Building the task is harmless (capture never calls loss_fn); only a replay's step runs
the fault."""
import os
import signal
import time

import torch
import torch.nn as nn

import nanbisect


def _fault(what: str):
    if what == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif what == "abort":
        os.abort()
    elif what == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif what == "hang":
        time.sleep(3600)
    elif what == "exit0":
        os._exit(0)
    elif what == "raise":
        raise RuntimeError("the loss function broke")


def _task(what: str) -> nanbisect.Task:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)

    def loss_fn(m, batch):
        _fault(what)
        return m(batch).pow(2).mean()

    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=loss_fn)


def fine():
    return _task("none")


def segfault():
    return _task("segfault")


def abort():
    return _task("abort")


def sigkill():
    return _task("sigkill")


def hang():
    return _task("hang")


def exit0():
    return _task("exit0")


def raises():
    return _task("raise")


def batch() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
