"""A tiny tied language model with BatchNorm (parameters, buffers, tied weights) and its
training, optimizers and exact comparisons: what the bundle's state round trips are
tested on (tests/bundle/test_bundle*.py)."""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanbisect import Task

ENTRY = f"{Path(__file__).resolve()}:make_model"  # capture checks that it exists, never imports it
VOCAB, DIM = 11, 6


# --------------------------------------------------------------------------------------------
# helpers


class TiedLM(nn.Module):
    """Embedding and output head share one weight; BatchNorm adds float and int64 buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens).mean(1)))


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["tokens"]), batch["target"])


def make_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, VOCAB, (8, 5), generator=g),
            "target": torch.randint(0, VOCAB, (8,), generator=g)}


def make_model(seed: int) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM()


def train(model: nn.Module, opt: torch.optim.Optimizer | None, seeds) -> None:
    for s in seeds:
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        lm_loss(model, make_batch(s)).backward()
        if opt is not None:
            opt.step()


def make_opt(kind: str, params, alt: bool = False) -> torch.optim.Optimizer:
    """``alt`` builds the same optimizer class with different hyper-parameters."""
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.3 if alt else 0.01,
                                betas=(0.5, 0.6) if alt else (0.8, 0.95), weight_decay=0.01)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.3 if alt else 0.02,
                                 betas=(0.5, 0.6) if alt else (0.85, 0.99), weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.3 if alt else 0.05, momentum=0.1 if alt else 0.9,
                               nesterov=not alt, weight_decay=0.0 if alt else 1e-3)
    raise AssertionError(kind)


def assert_tensor_identical(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), what
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    if a.is_floating_point():
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=what)
    else:
        assert torch.equal(a, b), what


def assert_opt_state_equal(sd1: dict, sd2: dict) -> None:
    assert sd1["param_groups"] == sd2["param_groups"]
    assert sd1["state"].keys() == sd2["state"].keys()
    for i, st in sd1["state"].items():
        assert st.keys() == sd2["state"][i].keys(), i
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert_tensor_identical(v, sd2["state"][i][k], f"state[{i}][{k}]")
            else:
                assert v == sd2["state"][i][k], f"state[{i}][{k}]"


def assert_same_tree(a, b, where: str = "batch") -> None:
    """Equal structure, leaf types and values; nan equals nan."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert_tensor_identical(a, b, where)
        assert a.requires_grad == b.requires_grad, f"{where}: requires_grad"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys"
        for (ka, va), kb in zip(a.items(), b.keys()):
            assert type(ka) is type(kb), f"{where}: key type of {ka!r}"
            assert_same_tree(va, b[kb], f"{where}[{ka!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def trained_task() -> Task:
    """A tied model trained two steps with Adam (non-trivial params, buffers, optimizer
    state)."""
    model = make_model(0)
    opt = make_opt("adam", model.parameters())
    train(model, opt, [1, 2])
    return Task(model=model, optimizer=opt, loss_fn=lm_loss)
