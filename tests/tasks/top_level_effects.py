"""An entry whose top level does what training scripts do (issue 43): it writes a marker file,
parses its command line and calls an init function, all at import. A replay refuses it (the
marker's write, line 20, is the first statement that does more than define) unless the run opts
in (``--run-top-level``); with it, the import writes the marker again, recording the ``sys.argv``
it saw (the file alone) and the parsed ``--lr``. ``task``'s loss is NaN where the model's output
is negative (``sqrt``): the batch ``batch()`` makes it so."""
import argparse
import logging
import os
import sys
from pathlib import Path

import torch

import nanbisect

# the marker's path comes from the environment: the test chooses it
MARKER = Path(os.environ.get("TOP_LEVEL_MARKER", "top-level-marker.txt"))
LOG = logging.getLogger("top_level_effects")
MARKER.write_text(f"imported: argv={sys.argv!r}\n")
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()
logging.basicConfig(level=logging.WARNING)         # the run's init (a tracker's, a logger's)
with MARKER.open("a") as f:
    f.write(f"lr={args.lr}\n")


def task() -> nanbisect.Task:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: torch.sqrt(m(b)).mean())


def batch() -> torch.Tensor:
    """A batch whose first row's output is negative (NaN under sqrt), the rest positive."""
    model = task().model
    x = torch.ones(4, 2)
    x[0] = -100 * torch.sign(model.weight[0].detach())
    x[1:] = 100 * torch.sign(model.weight[0].detach())
    return x                                            # (B, 2)


if __name__ == "__main__":
    print(task().loss_fn(task().model, batch()))
