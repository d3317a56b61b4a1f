"""The README's first capture example, as a user copied it (issue 28): the training loop at
module level, so importing the file to rebuild the model would train again. nanbisect must stop
it at ``Guard(...)``, before ``out`` exists and before any step."""
import torch

import nanbisect


def make_task():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


task = make_task()
guard = nanbisect.Guard(task, entry=f"{__file__}:make_task", out="stray-bundles")
for step in range(3):
    guard.step(torch.ones(4, 2))                        # (B, 2)
