"""Where a NaN is born (issue 38): small models of publicly reported NaN patterns, our own code.

- ``logsumexp_bag``: attention-free multiple-instance pooling, ``logsumexp`` over a bag's
  instance scores plus a bias that is ``-inf`` on masked instances (a legitimate mask). A bag
  whose instances are all masked pools to ``-inf``, which ``torch.where`` replaces by 0: forward is finite. The
  NaN is born in backward, in ``LogsumexpBackward0`` (``exp(-inf - -inf)``); the mask fill is
  the start of the chain (``inf_origin``), never the culprit.
- ``entropy_nan_to_num``: an entropy bonus over masked logits, ``-(p * log p)``, whose forward
  NaN (``0 * -inf``) ``nan_to_num`` removes; backward computes ``0 * saved -inf`` again in
  ``MulBackward0``: the NaN that reaches the gradients is born there.
- ``half_attention``: one attention head in float16 whose query-key products overflow 65504
  (inf scores); the softmax of a row holding inf makes NaN (inf - inf): the culprit is the
  softmax, the matmul that overflowed is ``inf_origin``.
- ``all_ignored_ce``: a token classifier's cross entropy with ``ignore_index``, on a batch whose
  every label is ignored: the mean over 0 labels is 0/0, born in ``nll_loss_forward``.
- ``token_mean_accumulated``: gradient accumulation over two micro-batches, each micro-batch's
  loss summed over its tokens and divided by its token count; the second micro-batch is all
  padding: 0/0 in its division.
"""
import torch
import torch.nn as nn

import nanbisect


class Pool(nn.Module):
    def forward(self, scores, mask):                 # (B, N), (B, N) bool: True = masked
        bias = torch.zeros_like(scores).masked_fill(mask, float("-inf"))   # legitimate -inf
        s = scores + bias
        pooled = torch.logsumexp(s, dim=1)           # BUG: an all-masked bag gives -inf
        return torch.where(torch.isfinite(pooled), pooled, torch.zeros_like(pooled))


class Bag(nn.Module):
    def __init__(self, dim: int = 6):
        super().__init__()
        self.score = nn.Linear(dim, 1)
        self.pool = Pool()

    def forward(self, x, mask):                      # x: (B, N, dim)
        return self.pool(self.score(x).squeeze(-1), mask)


class Entropy(nn.Module):
    def forward(self, logits, mask):
        z = logits.masked_fill(mask, float("-inf"))
        p, logp = torch.softmax(z, -1), torch.log_softmax(z, -1)
        return torch.nan_to_num(-(p * logp), nan=0.0).sum(-1)   # BUG: 0 * -inf, cleaned


class Policy(nn.Module):
    def __init__(self, dim: int = 6, actions: int = 4):
        super().__init__()
        self.head = nn.Linear(dim, actions)
        self.entropy = Entropy()

    def forward(self, x, mask):
        return self.entropy(self.head(x), mask)


def _task(model: nn.Module) -> nanbisect.Task:
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(*b).pow(2).mean())


def logsumexp_bag():
    torch.manual_seed(0)
    return _task(Bag())


def bag_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 6, generator=g)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[0, 1] = True
    mask[2] = True                                   # bag 2: every instance masked
    return x, mask


def entropy_nan_to_num():
    torch.manual_seed(0)
    return _task(Policy())


def entropy_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, generator=g)
    mask = torch.zeros(5, 4, dtype=torch.bool)
    mask[:, 3] = True                                # action 3 is never allowed
    return x, mask


class HalfAttention(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.qk = nn.Linear(dim, 2 * dim)
        with torch.no_grad():                        # q = k: a token's score with itself > 0
            self.qk.weight[dim:] = self.qk.weight[:dim]
            self.qk.bias[dim:] = self.qk.bias[:dim]

    def forward(self, x):                            # (B, T, dim) float32
        q, k = self.qk(x).half().chunk(2, -1)
        scores = q @ k.transpose(-1, -2)             # BUG: float16 overflows above 65504
        return torch.softmax(scores, -1).float() @ x


class Attend(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = HalfAttention()

    def forward(self, x):
        return self.attn(x)


def half_attention():
    torch.manual_seed(0)
    return nanbisect.Task(model=(m := Attend()),
                          optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def attention_batch():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 8, generator=g)
    x[1, 2] *= 1000.0                                # one token far out: its scores overflow
    return x


class Tagger(nn.Module):
    def __init__(self, dim: int = 6, tags: int = 5):
        super().__init__()
        self.head = nn.Linear(dim, tags)

    def forward(self, x):
        return self.head(x)


def _ce(model, batch):
    x, labels = batch
    return nn.functional.cross_entropy(model(x), labels, ignore_index=-100)


def all_ignored_ce():
    torch.manual_seed(0)
    m = Tagger()
    return nanbisect.Task(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                          loss_fn=_ce)


def ignored_batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, 6, generator=g), torch.full((4,), -100)   # every label ignored


def _token_mean(model, batch):
    x, mask = batch                                  # (B, T, dim), (B, T) 1 = a real token
    per_token = model(x).pow(2).sum(-1)
    return (per_token * mask).sum() / mask.sum()     # BUG: a micro-batch of padding: 0/0


def token_mean_accumulated():
    torch.manual_seed(0)
    m = Tagger()
    return nanbisect.Task(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                          loss_fn=_token_mean, accumulate=2)


def token_batches():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 6, generator=g)
    return [(x, torch.ones(2, 3)), (x.clone(), torch.zeros(2, 3))]   # the second: all padding
