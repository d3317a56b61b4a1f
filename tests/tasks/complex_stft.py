"""A multi-resolution STFT loss whose NaN passes through complex tensors (issue 38, item 3).

A tiny generator makes a waveform from a code; the loss compares its spectrogram with the
target's at several resolutions (``torch.stft``, Hann windows, no centring). The batch is
``(code, target, mask)``: ``mask`` zeroes the generator's output where the target is silent
(padding), so the frames that lie wholly in the silent tail have a spectrum that is exactly 0 on
both sides.

- ``hypot_at_zero``: the magnitude by hand, ``torch.hypot(S.real, S.imag)``; at a silent frame
  its backward divides 0 by 0 (``grad * re / hypot``): a real op in backward makes the NaN, and
  the FFT's backward carries it, complex, to the window multiply.
- ``compressed_at_zero``: a "power-law compressed" complex spectrum, ``S ** 0.3`` of the complex
  STFT; forward is finite (0 ** 0.3 = 0), its backward raises a complex 0 to the power -0.7: the
  NaN is born in a complex op, and the first real op it reaches is the STFT's window multiply.
- ``ratio_at_zero``: the ratio of the complex spectra, ``S_y / S_x``: at a silent frame a
  complex 0 / 0 in forward, whose NaN the (real) ``abs`` after it carries to the loss.
- ``healthy``: the same loss with the magnitude from ``S.abs()`` (whose backward is safe at 0).
"""
import torch
import torch.nn as nn

import nanbisect

T = 64                    # samples per waveform
SILENT = 32               # the tail from here on is silent (target and masked output)
FFTS = (16, 32)           # the resolutions of the loss


class Generator(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.fc = nn.Linear(dim, T)

    def forward(self, z, mask):
        return torch.tanh(self.fc(z)) * mask              # the silent tail is exactly 0


class Spectrogram(nn.Module):
    """The complex STFT at one resolution (a module: complex tensors cross its boundary)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.register_buffer("window", torch.hann_window(n))

    def forward(self, x):
        return torch.stft(x, n_fft=self.n, hop_length=self.n // 4, window=self.window,
                          center=False, return_complex=True)


class Compress(nn.Module):
    """A "power-law compressed" complex spectrum, as real and imaginary parts."""

    def forward(self, s):
        return torch.view_as_real(s ** 0.3)               # BUG: complex 0 ** -0.7 in backward


class STFTLoss(nn.Module):
    """Sum over resolutions of the L1 distance between spectra (``how``: "hypot", "compress",
    "abs"), or of the complex ratio of the spectra from 1 ("ratio")."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.specs = nn.ModuleDict({str(n): Spectrogram(n) for n in FFTS})
        self.compress = Compress()

    def spectrum(self, x, n):
        s = self.specs[str(n)](x)
        if self.how == "hypot":
            return torch.hypot(s.real, s.imag)            # BUG: hypot backward at 0 is 0/0
        if self.how == "compress":
            return self.compress(s)
        return s.abs()

    def forward(self, y, x):
        if self.how == "ratio":      # the transfer function's distance from 1, complex
            total = 0
            for n in FFTS:
                h = self.specs[str(n)](y) / self.specs[str(n)](x)   # BUG: 0 / 0 when silent
                total = total + (h - 1).abs().mean()
            return total
        return sum((self.spectrum(y, n) - self.spectrum(x, n)).abs().mean() for n in FFTS)


class Vocoder(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.gen = Generator()
        self.stft_loss = STFTLoss(how)

    def forward(self, batch):
        z, target, mask = batch
        return self.stft_loss(self.gen(z, mask), target)


def _task(how: str) -> nanbisect.Task:
    torch.manual_seed(0)
    model = Vocoder(how)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b))


def batch(n: int = 2, dim: int = 8, seed: int = 0):
    """(code, target, mask): random codes and targets, both silent from sample ``SILENT`` on."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, T)
    mask[:, SILENT:] = 0.0
    return torch.randn(n, dim, generator=g), torch.randn(n, T, generator=g) * mask, mask


def hypot_at_zero():
    return _task("hypot")


def compressed_at_zero():
    return _task("compress")


def ratio_at_zero():
    return _task("ratio")


def healthy():
    return _task("abs")
