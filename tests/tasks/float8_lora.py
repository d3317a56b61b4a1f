"""A LoRA layer that quantises its low-rank activations to float8 with a row-wise scale, as
float8 training emulated on a CPU does. ``lora_B`` starts at zero (LoRA's own initialisation):
every row of the low-rank output is 0, its scale 0, and the quantisation divides 0 by 0."""
import torch
import torch.nn as nn

import nanbisect

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantise(y: torch.Tensor) -> torch.Tensor:
    """Row-wise float8 round trip: scale each row to float8's range, cast, cast back."""
    scale = y.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    q = (y / scale).to(FP8)          # BUG: a zero row gives scale 0 and 0/0
    return q.float() * scale


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_A = nn.Parameter(torch.randn(rank, d_in) / d_in ** 0.5)
        self.lora_B = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x):
        return self.base(x) + quantise(x @ self.lora_A.T @ self.lora_B.T)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.lora = LoRALinear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.lora(torch.tanh(self.up(x))))).squeeze(-1)


def task():
    torch.manual_seed(0)
    model = Net()
    return nanbisect.Task(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                          loss_fn=lambda m, b: (m(b) ** 2).mean())


def batch():
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
