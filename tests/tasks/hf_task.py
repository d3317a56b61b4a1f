"""A tiny GPT-2 (built from a config, nothing downloaded) whose MLP activation takes sqrt."""
import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel

import nanbisect
from nanbisect.integrations.hf import hf_loss


class SqrtAct(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)                             # NaN for any negative pre-activation


def model():
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1,
                                   n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    m.transformer.h[0].mlp.act = SqrtAct()
    return m


def task():
    m = model()
    return nanbisect.Task(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3),
                          loss_fn=hf_loss)


def dataset():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (8, 8), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


def task_eps0():
    """AdamW with eps=0: embedding rows no position uses get 0 / (sqrt(0) + 0) = NaN at the
    first update (an optimizer NaN with a finite loss); no SqrtAct."""
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1,
                                   n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return nanbisect.Task(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3, eps=0.0),
                          loss_fn=hf_loss)


def dataset_low_tokens():
    """Tokens from the lower half of the vocabulary only: the upper rows get no gradient."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 25, (8, 8), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


def task_wide():
    """A healthy tiny GPT-2 with embeddings of 128 (its weights dwarf a step's RNG state: the
    Guard's memory, issue 40)."""
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=128, n_layer=1,
                                   n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return nanbisect.Task(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3),
                          loss_fn=hf_loss)
