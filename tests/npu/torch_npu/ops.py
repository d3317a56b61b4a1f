"""Device-only kernels (``torch.ops.npu.*``), registered for the ``npu`` key only, with their own
autograd. The CPU has no kernel for them, as it has none for ``torch_npu``'s fused ops: a CPU
reference needs a registered ``nanbisect.reference_impl``.

- ``npu_moe_unpermute(expert_out, probs)``: an MoE block's combine (each token's expert output
  scaled by its routing probability). Its backward, ``npu_moe_unpermute_backward``, is the seed
  case's bug: the kernel supports bfloat16 ``probs`` only, and given float32 ``probs`` it returns
  NaN for the expert outputs' gradient, silently.
- ``npu_fast_gelu(x)``: GELU computed through bfloat16 on the device, whatever ``x``'s dtype: a
  silent divergence from the CPU (no NaN, an error of about 2**-8 relative), in forward only.
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("npu", "DEF")
_lib.define("npu_moe_unpermute(Tensor expert_out, Tensor probs) -> Tensor")
_lib.define("npu_moe_unpermute_backward(Tensor grad, Tensor expert_out, Tensor probs)"
            " -> (Tensor, Tensor)")
_lib.define("npu_fast_gelu(Tensor x) -> Tensor")
_lib.define("npu_fast_gelu_backward(Tensor grad, Tensor x) -> Tensor")


def _unpermute(expert_out, probs):
    return expert_out * probs.to(expert_out.dtype)[:, None]


def _unpermute_backward(grad, expert_out, probs):
    grad_probs = (grad * expert_out).sum(-1).to(probs.dtype)
    if probs.dtype != torch.bfloat16:       # the kernel's float32 path: NaN, silently
        return torch.full_like(grad, float("nan")), grad_probs
    return grad * probs.to(grad.dtype)[:, None], grad_probs


def _fast_gelu(x):
    return torch.nn.functional.gelu(x.to(torch.bfloat16)).to(x.dtype)


def _fast_gelu_backward(grad, x):
    return torch.ops.aten.gelu_backward(grad, x)


for _name, _fn in (("npu_moe_unpermute", _unpermute),
                   ("npu_moe_unpermute_backward", _unpermute_backward),
                   ("npu_fast_gelu", _fast_gelu),
                   ("npu_fast_gelu_backward", _fast_gelu_backward)):
    _lib.impl(_name, _fn, "PrivateUse1")

torch.library.register_fake("npu::npu_moe_unpermute",
                            lambda expert_out, probs: torch.empty_like(expert_out), lib=_lib)
torch.library.register_fake("npu::npu_moe_unpermute_backward",
                            lambda grad, expert_out, probs: (torch.empty_like(grad),
                                                             torch.empty_like(probs)), lib=_lib)
torch.library.register_fake("npu::npu_fast_gelu", lambda x: torch.empty_like(x), lib=_lib)
torch.library.register_fake("npu::npu_fast_gelu_backward",
                            lambda grad, x: torch.empty_like(x), lib=_lib)


def _keep_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _unpermute_grad(ctx, grad):
    expert_out, probs = ctx.saved_tensors
    return torch.ops.npu.npu_moe_unpermute_backward(grad, expert_out, probs)


def _fast_gelu_grad(ctx, grad):
    return torch.ops.npu.npu_fast_gelu_backward(grad, ctx.saved_tensors[0])


torch.library.register_autograd("npu::npu_moe_unpermute", _unpermute_grad,
                                setup_context=_keep_inputs, lib=_lib)
torch.library.register_autograd("npu::npu_fast_gelu", _fast_gelu_grad,
                                setup_context=_keep_inputs, lib=_lib)

npu_moe_unpermute = torch.ops.npu.npu_moe_unpermute
npu_fast_gelu = torch.ops.npu.npu_fast_gelu
