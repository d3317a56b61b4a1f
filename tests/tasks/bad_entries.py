"""Entries that are wrong in the ways users get them wrong."""
import torch


def not_a_task():
    return torch.nn.Linear(2, 2)


def raises():
    raise ValueError("config file missing")


NOT_CALLABLE = 3
