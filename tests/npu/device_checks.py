"""Measurements of the emulated NPU device itself (tests/npu/torch_npu), for
tests/base/test_npu_device.py.

Run as ``python tests/npu/device_checks.py`` with ``tests/npu`` on ``PYTHONPATH`` (the tests'
``npu_env``); prints one JSON object: for each check (a key), the facts it measured (values,
dtypes, counts, error types and messages), which the tests assert. A check that raises records
``{"error": "Type: message"}`` under its key instead, and the other checks still run.
"""
from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

T0 = time.perf_counter()
import torch_npu  # noqa: E402,F401  (the device: torch.npu, "npu:0", "npu:1")

IMPORT_S = time.perf_counter() - T0
CHECKS = {}


def check(fn):
    """Register ``fn`` (returning a dict of facts) as the check named after it."""
    CHECKS[fn.__name__] = fn
    return fn


def err(fn) -> str | None:
    """``"Type: first line of message"`` of what ``fn()`` raised, None when it did not."""
    try:
        fn()
    except Exception as e:      # noqa: BLE001  (any error is a fact to report)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


@check
def device_module():
    npu = torch.npu
    first = npu.current_device()
    npu.set_device(1)
    after_set = npu.current_device()
    plain = torch.empty(2, device="npu")          # index taken from the current device
    with npu.device(0):
        inside = npu.current_device()
    after_ctx = npu.current_device()
    npu.set_device(0)
    a, b = torch.ones(2, device="npu:0"), torch.ones(2, device="npu:1")
    t = torch.arange(3.0).npu()
    t1 = torch.arange(3.0).npu(1)
    on1 = {"ones": torch.ones(3, device="npu:1"),
           "arange": torch.arange(6, device="npu:1"),            # an out= kernel, resized
           "add": torch.ones(3, device="npu:1") + 1,
           "cat": torch.cat([torch.ones(2, device="npu:1")] * 2),
           "resize_": torch.ones(2, device="npu:1").resize_(64),
           "to": torch.ones(3).to("npu:1")}
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = [p.detach().clone() for p in params]
    model.to("npu")
    model(torch.ones(4, 3, device="npu")).sum().backward()
    opt.step()
    return {
        "is_available": npu.is_available(), "device_count": npu.device_count(),
        "current_first": first, "current_after_set_1": after_set,
        "empty_after_set_1": str(plain.device), "inside_device_ctx_0": inside,
        "after_device_ctx": after_ctx, "name": npu.get_device_name(),
        "name_1": npu.get_device_name("npu:1"),
        "devices": [str(a.device), str(b.device)], "indices": [a.get_device(), b.get_device()],
        "npu1_storage_devices": {k: [str(v.device), str(v.untyped_storage().device)]
                                 for k, v in on1.items()},
        "tensor_npu": str(t.device), "tensor_npu_1": str(t1.device), "is_npu": t.is_npu,
        "cpu_is_npu": torch.ones(1).is_npu, "npu_values": t.cpu().tolist(),
        "same_parameters": all(x is y for x, y in zip(params, model.parameters())),
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "optimizer_stepped": all(not torch.equal(p.detach().cpu(), q)
                                 for p, q in zip(model.parameters(), before)),
        "out_of_range": err(lambda: torch.ones(1, device="npu:2")),
    }


@check
def views():
    base = torch.zeros(4, 6, device="npu")
    base.view(24)[0] = 1                        # (0, 0)
    base.t()[1, 0] = 2                          # (0, 1)
    base[1:3, 2:4] = 3                          # a 2x2 block
    base.as_strided((2,), (6,), 5)[1] = 4       # (1, 5)
    base.unfold(1, 2, 2)[3, 0, 1] = 5           # (3, 1)
    base.select(0, 3)[5] = 6                    # (3, 5)
    base.view(-1).narrow(0, 12, 1).fill_(7)     # (2, 0)
    base[3].mul_(10)
    ref = torch.zeros(4, 6)
    ref.view(24)[0] = 1
    ref.t()[1, 0] = 2
    ref[1:3, 2:4] = 3
    ref.as_strided((2,), (6,), 5)[1] = 4
    ref.unfold(1, 2, 2)[3, 0, 1] = 5
    ref.select(0, 3)[5] = 6
    ref.view(-1).narrow(0, 12, 1).fill_(7)
    ref[3].mul_(10)
    v = base.view(24)
    return {"npu": base.cpu().tolist(), "cpu": ref.tolist(),
            "view_shares_storage": v.untyped_storage().data_ptr()
            == base.untyped_storage().data_ptr(),
            "view_device": str(v.device)}


@check
def copies():
    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(3))
    x[0, 0] = float("nan")
    x[0, 1] = float("-inf")
    d0 = x.to("npu:0")
    d1 = d0.to("npu:1")
    back = d1.cpu()
    d0b = d1.to("npu:0")
    half = d0.to(torch.bfloat16)
    dst = torch.empty(64, 33, dtype=torch.float64, device="npu:1")
    dst.copy_(d0)
    pinned = x.pin_memory()
    nb = pinned.to("npu:1", non_blocking=True)
    nb_back = torch.empty(64, 33).pin_memory()
    nb_back.copy_(nb, non_blocking=True)
    return {
        "round_trip_equal": torch.equal(back, x) if not x.isnan().any() else
        bool(torch.equal(back.nan_to_num(), x.nan_to_num()) and
             torch.equal(back.isnan(), x.isnan())),
        "round_trip_bits_equal": torch.equal(back.view(torch.int32), x.view(torch.int32)),
        "d2d_bits_equal": torch.equal(d0b.cpu().view(torch.int32), x.view(torch.int32)),
        "devices": [str(d0.device), str(d1.device), str(d0b.device)],
        "bf16_dtype": str(half.dtype), "bf16_device": str(half.device),
        "bf16_bits_equal_cpu": torch.equal(half.cpu().view(torch.int16),
                                           x.to(torch.bfloat16).view(torch.int16)),
        "f64_copy_device": str(dst.device), "f64_copy_dtype": str(dst.dtype),
        "f64_copy_equal_cpu": bool(torch.equal(dst.cpu().nan_to_num(),
                                               x.double().nan_to_num())),
        "pinned_is_pinned": pinned.is_pinned(), "plain_is_pinned": x.is_pinned(),
        "pinned_equal": torch.equal(pinned.view(torch.int32), x.view(torch.int32)),
        "non_blocking_device": str(nb.device),
        "non_blocking_bits_equal": torch.equal(nb.cpu().view(torch.int32),
                                               x.view(torch.int32)),
        "non_blocking_back_bits_equal": torch.equal(nb_back.view(torch.int32),
                                                    x.view(torch.int32)),
        "sliced_pinned_is_pinned": pinned[3:].is_pinned(),
    }


def _draws(device: str) -> list[torch.Tensor]:
    """One of each random op the device routes to its generator, on ``device``."""
    ones = torch.full((200,), 0.5, device=device)
    return [torch.randn(50, device=device), torch.rand(50, device=device),
            F.dropout(torch.ones(200, device=device), 0.5, training=True),
            torch.bernoulli(ones), torch.randint(0, 1000, (50,), device=device),
            torch.empty(50, device=device).normal_(), torch.randperm(50, device=device),
            torch.multinomial(ones, 5)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[bool]:
    return [torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b)]


@check
def rng():
    torch.npu.manual_seed(1234)
    first = _draws("npu")
    torch.npu.manual_seed(1234)
    again = _draws("npu")
    third = _draws("npu")
    cpu_state = torch.get_rng_state()
    _draws("npu:0")
    _draws("npu:1")
    cpu_unchanged = torch.equal(torch.get_rng_state(), cpu_state)
    state = torch.npu.get_rng_state()
    a = _draws("npu")
    torch.npu.set_rng_state(state)
    b = _draws("npu")
    # independence: draws on npu:1 do not move npu:0's generator, and the reverse
    torch.npu.manual_seed_all(7)
    only0 = torch.randn(20, device="npu:0")
    torch.npu.manual_seed_all(7)
    seeded = torch.npu.get_rng_state(0), torch.npu.get_rng_state(1)
    torch.randn(20, device="npu:1")
    after_npu1 = torch.npu.get_rng_state(0), torch.npu.get_rng_state(1)
    interleaved = torch.randn(20, device="npu:0")
    after_npu0 = torch.npu.get_rng_state(0), torch.npu.get_rng_state(1)
    # torch.manual_seed reaches the device module's manual_seed_all
    torch.manual_seed(99)
    seeded0, seeded1 = torch.randn(20, device="npu:0"), torch.randn(20, device="npu:1")
    torch.npu.manual_seed_all(99)
    ref0, ref1 = torch.randn(20, device="npu:0"), torch.randn(20, device="npu:1")
    torch.npu.manual_seed_all(5)
    torch.manual_seed(99)
    cpu_draw = torch.randn(20)
    torch.manual_seed(99)
    gen = torch.Generator(device="npu:1").manual_seed(11)
    g_a = torch.randn(20, device="npu:1", generator=gen)
    gen.manual_seed(11)
    g_b = torch.randn(20, device="npu:1", generator=gen)
    return {
        "ops": ["randn", "rand", "dropout", "bernoulli", "randint", "normal_", "randperm",
                "multinomial"],
        "reseed_repeats": _same(first, again), "next_draw_same": _same(again, third),
        "cpu_state_unchanged": cpu_unchanged,
        "set_state_repeats": _same(a, b),
        "state_dtype": str(state.dtype), "state_numel": state.numel(),
        "npu1_draw_leaves_npu0_draws": torch.equal(only0.cpu(), interleaved.cpu()),
        "npu1_draw_leaves_npu0_state": torch.equal(seeded[0], after_npu1[0]),
        "npu1_draw_moves_npu1_state": not torch.equal(seeded[1], after_npu1[1]),
        "npu0_draw_leaves_npu1_state": torch.equal(after_npu1[1], after_npu0[1]),
        "npu0_draw_moves_npu0_state": not torch.equal(after_npu1[0], after_npu0[0]),
        "torch_manual_seed_reaches_npu": [torch.equal(seeded0.cpu(), ref0.cpu()),
                                          torch.equal(seeded1.cpu(), ref1.cpu())],
        "npu_draw_equals_cpu_draw_same_seed": torch.equal(seeded0.cpu(), cpu_draw),
        "initial_seed": torch.npu.initial_seed(),
        "explicit_generator_repeats": torch.equal(g_a.cpu(), g_b.cpu()),
        "explicit_generator_device": str(gen.device),
    }


def _train(device: str, make_opt) -> list[torch.Tensor]:
    """Three steps of a small MLP (no dropout) on ``device``; its parameters afterwards, on the
    host."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.to(device)
    opt = make_opt(model.parameters())
    for _ in range(3):
        x = torch.randn(8, 16, generator=g).to(device)
        y = torch.randn(8, 4, generator=g).to(device)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@check
def training():
    optimizers = {
        "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
        "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    }
    out = {}
    for name, make in optimizers.items():
        try:
            cpu, npu = _train("cpu", make), _train("npu", make)
            first = _train("cpu", lambda ps: torch.optim.SGD(ps, lr=0.0))
            out[name] = {"equal": [torch.equal(a, b) for a, b in zip(cpu, npu)],
                         "moved": any(not torch.equal(a, b) for a, b in zip(cpu, first)),
                         "max_abs_diff": max(float((a - b).abs().max())
                                             for a, b in zip(cpu, npu))}
        except Exception as e:      # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


@check
def autocast():
    lin = torch.nn.Linear(8, 4).to("npu")
    x = torch.randn(3, 8, device="npu")
    with torch.autocast("npu", dtype=torch.bfloat16):
        inside = lin(x)
        mm = x @ x.t()
        added = x + 1
    outside = lin(x)
    with torch.autocast("npu", dtype=torch.float16):
        f16 = lin(x)
    return {"linear_inside": str(inside.dtype), "matmul_inside": str(mm.dtype),
            "add_inside": str(added.dtype), "linear_outside": str(outside.dtype),
            "linear_inside_f16": str(f16.dtype), "device": str(inside.device)}


@check
def streams():
    npu = torch.npu
    s = npu.Stream()
    cur = npu.current_stream()
    ev = s.record_event()
    cur.wait_event(ev)
    cur.wait_stream(s)
    e2 = npu.Event()
    e2.record()
    e2.synchronize()
    t = torch.ones(4, device="npu")
    t.record_stream(s)
    with npu.stream(s):
        t2 = t * 2
    values = t2.cpu().tolist()
    calls = {"torch.npu.synchronize()": npu.synchronize,
             "torch.npu.synchronize(1)": lambda: npu.synchronize(1),
             "Stream.synchronize()": s.synchronize,
             "torch.accelerator.synchronize()": torch.accelerator.synchronize,
             "no call": lambda: None}
    added = {}
    for name, call in calls.items():        # what each call adds to the count, on its own
        before = npu.synchronizations()
        call()
        added[name] = npu.synchronizations() - before
    return {"stream_device": str(s.device), "current_device": str(cur.device),
            "event_query": ev.query(), "stream_query": s.query(), "t2": values,
            "synchronizations_added": added}


@check
def serialization():
    from safetensors.torch import load_file, save_file

    x = torch.randn(5, 7, device="npu:0")
    y = torch.arange(6, dtype=torch.int64, device="npu:1")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.safetensors")
        save_file({"x": x, "y": y}, path)
        loaded = load_file(path, device="npu:1")
        buf = io.BytesIO()
        torch.save({"x": x, "y": y}, buf)
        buf.seek(0)
        back = torch.load(buf)
        buf.seek(0)
        mapped = torch.load(buf, map_location="cpu")
    return {
        "safetensors_devices": {k: str(v.device) for k, v in loaded.items()},
        "safetensors_equal": torch.equal(loaded["x"].cpu(), x.cpu()) and
        torch.equal(loaded["y"].cpu(), y.cpu()),
        "torch_load_devices": {k: str(v.device) for k, v in back.items()},
        "torch_load_equal": torch.equal(back["x"].cpu(), x.cpu()) and
        torch.equal(back["y"].cpu(), y.cpu()),
        "map_location_cpu_devices": {k: str(v.device) for k, v in mapped.items()},
    }


@check
def device_ops():
    g = torch.Generator().manual_seed(5)
    eo = torch.randn(6, 8, generator=g)
    probs = torch.rand(6, generator=g)
    out = torch_npu.npu_moe_unpermute(eo.npu(), probs.npu())
    facts = {"unpermute_device": str(out.device),
             "unpermute_equal_ref": torch.equal(out.cpu(), eo * probs[:, None])}
    for dtype in (torch.float32, torch.bfloat16):
        e = eo.npu().requires_grad_()
        p = probs.to(dtype).npu().requires_grad_()
        torch_npu.npu_moe_unpermute(e, p).sum().backward()
        name = str(dtype).split(".")[-1]
        facts[f"grad_expert_nan_{name}"] = bool(e.grad.isnan().all())
        facts[f"grad_expert_finite_{name}"] = bool(e.grad.isfinite().all())
        facts[f"grad_probs_finite_{name}"] = bool(p.grad.isfinite().all())
        facts[f"grad_probs_dtype_{name}"] = str(p.grad.dtype)
    facts["unpermute_cpu_error"] = err(lambda: torch_npu.npu_moe_unpermute(eo, probs))
    facts["fast_gelu_cpu_error"] = err(lambda: torch_npu.npu_fast_gelu(eo))
    x = torch.randn(4096, generator=g) * 3
    fast = torch_npu.npu_fast_gelu(x.npu()).cpu()
    ref = F.gelu(x)
    big = ref.abs() > 1e-3
    pos = x > 0.1
    facts.update({
        "fast_gelu_dtype": str(fast.dtype),
        "fast_gelu_max_abs_diff": float((fast - ref).abs().max()),
        "fast_gelu_max_rel_diff": float(((fast - ref).abs()[big] / ref.abs()[big]).max()),
        "fast_gelu_max_rel_diff_positive": float(((fast - ref)[pos] / ref[pos]).abs().max()),
        "fast_gelu_norm_rel_diff": float((fast - ref).norm() / ref.norm()),
        "fast_gelu_allclose_fp32": torch.allclose(fast, ref),
        "fast_gelu_equals_bf16_rounding": torch.equal(
            fast, F.gelu(x.to(torch.bfloat16)).float()),
    })
    return facts


def main() -> None:
    facts = {"import_s": IMPORT_S, "torch_version": torch.__version__,
             "cache_dir": str(torch_npu._build.directory()),
             "cache_dir_exists": torch_npu._build.directory().is_dir()}
    for name, fn in CHECKS.items():
        try:
            facts[name] = fn()
        except Exception as e:      # noqa: BLE001  (one check's failure is its test's to report)
            facts[name] = {"error": f"{type(e).__name__}: {e}",
                           "traceback": traceback.format_exc()[-2000:]}
    json.dump(facts, sys.stdout, indent=1, default=str)
    print()


if __name__ == "__main__":
    main()
