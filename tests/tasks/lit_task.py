"""A LightningModule trained with Adam at eps=0 (tests/integrations/test_integrations.py; the sqrt module of
the Lightning example is examples/lightning_train.py)."""
import lightning as L
import torch
import torch.nn as nn

from nanbisect.integrations.lightning import task_from_module


class LitBag(L.LightningModule):
    """Adam with eps=0 on an embedding whose upper rows no token uses: NaN at the first update."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        tokens, y = batch
        return nn.functional.mse_loss(self.head(self.embed(tokens).mean(1)).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2, eps=0.0)


def bag_data():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (16, 5), generator=g)
    return torch.utils.data.TensorDataset(tokens, tokens.float().mean(1))


def bag_task():
    return task_from_module(LitBag())


class LitWide(L.LightningModule):
    """A healthy module with weights of 16384 elements (the Guard's memory, issue 40)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def wide_data():
    return torch.utils.data.TensorDataset(torch.randn(96, 64,
                                                      generator=torch.Generator().manual_seed(0)))


def wide_task():
    return task_from_module(LitWide())
