"""The diagnosis comparison: on planted NaN causes of the kinds a held-out round found nanbisect
slipping on (float8, work outside the dispatcher, a NaN carried by a buffer, several bad batch
rows through the shapes a model gives them), what nanbisect, ``torch.autograd.detect_anomaly``
and transformers' ``DebugUnderflowOverflow`` each name, side by side in one run, against the
planted truth.

Each case is a task of tests/tasks/ trained for up to 3 steps, from the same seed, by each tool:

- nanbisect: `nanbisect.Guard` over the steps, then `run_bundle` of the bundle it wrote (the
  default remedy budget): the step, phase, module, op and the batch rows its samples remedy
  verified;
- ``detect_anomaly(check_nan=True)`` around each step: the autograd node whose backward first
  returned NaN, and the step;
- ``DebugUnderflowOverflow`` on the model: the module whose forward output first held a NaN or
  an inf (the last frame it prints), and the step.

"right" is the planted phase, module and op (or node) at the step that made the value; rows,
where the case plants several bad ones, must be exactly the planted ones.

    python scripts/diagnosis_cases.py [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "tasks"
sys.path.insert(0, str(TASKS))
sys.path.insert(0, str(ROOT))

import nanbisect  # noqa: E402
from nanbisect.pipeline import RunOptions, run_bundle  # noqa: E402

TWELVE = [0, 1, 2, 3, 4, 5, 6, 8, 9, 11, 13, 14]


@dataclass
class Case:
    name: str
    module: str                   # the task file in tests/tasks
    factory: str                  # its Task factory
    batches: Callable[[object], list]
    truth: dict                   # step, phase, module, op (and rows)


CASES = [
    Case("float8 LoRA: row-wise scale of a zero lora_B, 0/0", "float8_lora", "task",
         lambda m: [m.batch()] * 3,
         {"step": 0, "phase": "forward", "module": "lora", "op": "aten.div.Tensor"}),
    Case("a kernel outside the dispatcher (NumPy on the tensor's buffer)", "outside_dispatcher",
         "task", lambda m: [m.batch()] * 3,
         {"step": 0, "phase": "forward", "module": "fused", "op": None}),
    Case("VQ-VAE codebook's moving average, 0/0 in a buffer (loss finite that step)",
         "vq_buffer", "task", lambda m: [m.batch(s) for s in range(3)],
         {"step": 0, "phase": "forward", "module": "vq", "op": "aten.div.Tensor"}),
    Case("attention LM, 3 empty documents of 16 (qkv view/permute)", "many_rows", "attention",
         lambda m: [m.tokens(empty=(2, 7, 11))] * 3,
         {"step": 0, "phase": "forward", "module": "attn", "op": "aten._softmax.default",
          "rows": [2, 7, 11]}),
    Case("checkpointed unit norm, 12 zero rows of 16", "many_rows", "checkpointed",
         lambda m: [m.features(zero=TWELVE)] * 3,
         {"step": 0, "phase": "forward", "module": "unit", "op": "aten.div.Tensor",
          "rows": TWELVE}),
    Case("checkpointed where(h > 0, sqrt(h), 0): NaN in backward, 12 rows of 16", "many_rows",
         "checkpointed_backward", lambda m: [m.features(zero=TWELVE)] * 3,
         {"step": 0, "phase": "backward", "module": "unit", "op": "aten.div.Tensor",
          "node": "SqrtBackward0", "rows": TWELVE}),
]


def _task(case: Case):
    mod = __import__(case.module)
    return mod, getattr(mod, case.factory)()


def _plain(task, batch) -> torch.Tensor:
    task.optimizer.zero_grad()
    loss = task.loss_fn(task.model, batch)
    loss.backward()
    task.optimizer.step()
    return loss


def with_nanbisect(case: Case, tmp: Path) -> dict:
    mod, task = _task(case)
    guard = nanbisect.Guard(task, entry=f"{TASKS / (case.module + '.py')}:{case.factory}",
                            out=tmp / f"{case.factory}-g")
    try:
        for batch in case.batches(mod):
            guard.step(batch)
        return {"names": None}
    except nanbisect.NonFiniteStep as e:
        failed = e
    r = run_bundle(failed.bundle, RunOptions(run_repro=False, remedies=4),
                   tmp / f"{case.factory}-r")
    c = r.culprit
    rows = next((m.detail.get("rows") for m in r.remedies
                 if m.kind == "samples" and m.outcome == "finite"), None)
    return {"step": failed.observed.get("step"), "phase": c.phase if c else r.phase,
            "module": c.module if c else None, "op": c.op if c else None,
            "node": c.node.name if c is not None and c.node is not None else None,
            "rows": rows, "verdict": r.verdict}


def with_anomaly(case: Case) -> dict:
    mod, task = _task(case)
    for step, batch in enumerate(case.batches(mod)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")     # "anomaly detection is enabled"
                with torch.autograd.detect_anomaly(check_nan=True):
                    _plain(task, batch)
        except RuntimeError as e:
            m = re.search(r"Function '(\w+)' returned nan", str(e))
            return {"step": step, "phase": "backward", "node": m.group(1) if m else None}
    return {"names": None}


def with_duo(case: Case) -> dict:
    from transformers.debug_utils import DebugUnderflowOverflow

    mod, task = _task(case)
    DebugUnderflowOverflow(task.model)
    for step, batch in enumerate(case.batches(mod)):
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                _plain(task, batch)
        except ValueError:
            frames = re.findall(r"^ {17} (\S+) (\w+)$", buf.getvalue(), flags=re.M)
            return {"step": step, "phase": "forward",
                    "module": frames[-1][0] if frames else None}
    return {"names": None}


def right(said: dict, truth: dict, tool: str) -> bool:
    """The planted step, phase and module, and the op (nanbisect) or the backward node
    (detect_anomaly; the op's node where the truth names one), and the rows where planted."""
    if said.get("step") != truth["step"] or said.get("phase") != truth["phase"] and \
            tool != "detect_anomaly":
        return False
    if tool == "nanbisect":
        return (said.get("module"), said.get("op")) == (truth["module"], truth["op"]) and (
            "rows" not in truth or said.get("rows") == truth["rows"])
    if tool == "detect_anomaly":
        return truth.get("node") is not None and said.get("node") == truth["node"]
    return (said.get("module") or "").removeprefix("module.") == truth["module"]


def cell(said: dict) -> str:
    if said.get("names", "") is None:
        return "nothing"
    bits = [f"step {said['step']}"]
    for key in ("phase", "module", "op", "node"):
        if said.get(key) not in (None, ""):
            bits.append(f"{key} `{said[key]}`")
    if said.get("rows") is not None:
        bits.append(f"rows {said['rows']}")
    return ", ".join(bits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            said = {"nanbisect": with_nanbisect(case, Path(tmp)),
                    "detect_anomaly": with_anomaly(case), "DebugUnderflowOverflow": with_duo(case)}
            out.append({"case": case.name, "truth": case.truth, "said": said,
                        "right": {k: right(v, case.truth, k) for k, v in said.items()}})
            print(f"{case.name}: " + "; ".join(
                f"{k}: {cell(v)} ({'right' if out[-1]['right'][k] else 'wrong'})"
                for k, v in said.items()), flush=True)
    print("\n| case | nanbisect | `detect_anomaly` | `DebugUnderflowOverflow` |")
    print("|---|---|---|---|")
    for row in out:
        cells = [f"{cell(row['said'][k])} {'(right)' if row['right'][k] else '(wrong)'}"
                 for k in ("nanbisect", "detect_anomaly", "DebugUnderflowOverflow")]
        print(f"| {row['case']} | " + " | ".join(cells) + " |")
    totals = {k: sum(r["right"][k] for r in out) for k in out[0]["right"]}
    print("\nright: " + ", ".join(f"{k} {v} of {len(out)}" for k, v in totals.items()))
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "cases": out}, indent=1))


if __name__ == "__main__":
    main()
