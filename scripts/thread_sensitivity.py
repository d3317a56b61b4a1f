"""Which CPU ops give other bits with another intra-op thread count, on this machine's torch.

A replay that runs with fewer threads than the capture (a triage worker's share of the cores,
``OMP_NUM_THREADS``) computes the same ops; the ones torch splits by thread may add in another
order and differ in the last bits. For each op and dtype this runs the op once with 1 intra-op
thread and again with each count of ``--threads`` on the same seeded inputs (large enough that
torch splits the work: a few million elements), and prints whether the results are the same bits
and, if not, the largest difference relative to the result's largest magnitude. The thread
count decides the split, not the cores: 4 threads on 2 cores split as on 4.
Usage: python scripts/thread_sensitivity.py [--threads 2,4,8] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F

N = 1 << 22          # elements of a flat input: well past at::internal::GRAIN_SIZE per thread


def _cases():
    """(name, build(dtype, generator) -> args, fn(*args))."""
    def flat(dt, g):
        return (torch.randn(N, generator=g).to(dt),)

    def rows(dt, g):
        return (torch.randn(512, 8192, generator=g).to(dt),)

    def mats(dt, g):
        return (torch.randn(256, 4096, generator=g).to(dt),
                torch.randn(4096, 256, generator=g).to(dt))

    def ln(dt, g):
        return (torch.randn(512, 8192, generator=g).to(dt), torch.randn(8192, generator=g).to(dt),
                torch.randn(8192, generator=g).to(dt))

    def conv(dt, g):
        return (torch.randn(8, 64, 64, 64, generator=g).to(dt),
                torch.randn(64, 64, 3, 3, generator=g).to(dt))

    def emb(dt, g):
        return (torch.randn(50000, 256, generator=g).to(dt),
                torch.randint(0, 50000, (16384,), generator=g))

    def logits(dt, g):
        return (torch.randn(16384, 256, generator=g).to(dt),
                torch.randint(0, 256, (16384,), generator=g))

    def bn(dt, g):
        return (torch.randn(64, 32, 32, 32, generator=g).to(dt),)

    def qkv(dt, g):
        return tuple(torch.randn(4, 8, 512, 64, generator=g).to(dt) for _ in range(3))

    return [
        ("cross_entropy (mean)", logits, lambda x, y: F.cross_entropy(x, y)),
        ("batch_norm (training)", bn, lambda x: F.batch_norm(x, None, None, training=True)),
        ("scaled_dot_product_attention", qkv,
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v)),
        ("sum (all elements)", flat, lambda x: x.sum()),
        ("mean (all elements)", flat, lambda x: x.mean()),
        ("sum over the last dim", rows, lambda x: x.sum(-1)),
        ("linalg.vector_norm", flat, lambda x: torch.linalg.vector_norm(x)),
        ("var", flat, lambda x: x.var()),
        ("cumsum", rows, lambda x: x.cumsum(-1)),
        ("softmax (last dim)", rows, lambda x: x.softmax(-1)),
        ("log_softmax (last dim)", rows, lambda x: x.log_softmax(-1)),
        ("layer_norm", ln, lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b)),
        ("mm", mats, lambda a, b: a @ b),
        ("conv2d", conv, lambda x, w: F.conv2d(x, w, padding=1)),
        ("embedding backward (index_add)", emb,
         lambda w, i: torch.zeros_like(w).index_add_(
             0, i, torch.ones(i.numel(), w.shape[1], dtype=w.dtype))),
        ("elementwise: x * y + exp(x)", lambda dt, g: flat(dt, g) + flat(dt, g),
         lambda x, y: x * y + x.exp()),
    ]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="2,4,8", help="thread counts compared with 1")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    counts = [int(t) for t in a.threads.split(",")]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.backends.cpu.get_cpu_capability()}; 1 thread against {counts}")
    rows = []
    for name, build, fn in _cases():
        for dt in dtypes:
            args = build(dt, torch.Generator().manual_seed(0))
            torch.set_num_threads(1)
            try:
                ref = fn(*args)
            except (RuntimeError, NotImplementedError) as e:
                rows.append({"op": name, "dtype": str(dt)[6:], "error": str(e).splitlines()[0]})
                continue
            diffs = {}
            for t in counts:
                torch.set_num_threads(t)
                out = fn(*args)
                diffs[t] = 0.0 if torch.equal(out, ref) else _relative(out, ref)
            rows.append({"op": name, "dtype": str(dt)[6:], "relative": diffs})
    print(f"| op | dtype | {' | '.join(f'{t} threads' for t in counts)} |")
    print(f"|---|---|{'---:|' * len(counts)}")
    for r in rows:
        cells = ([r["error"][:40]] if "error" in r else
                 ["same bits" if r["relative"][t] == 0 else f"differs ({r['relative'][t]:.1e})"
                  for t in counts])
        print(f"| {r['op']} | {r['dtype']} | {' | '.join(cells)} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
