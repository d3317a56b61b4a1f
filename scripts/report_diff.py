"""Same reports before and after a change: run `nanbisect run` on bundles with two checkouts and
diff what they wrote (issue 29's guardrail: a speed-up must not change any report).

    python scripts/report_diff.py collect --root CHECKOUT --out DIR [BUNDLE ...]
    python scripts/report_diff.py compare DIR_A DIR_B

``collect`` runs ``python -m nanbisect run BUNDLE --out DIR/NAME`` in a fresh interpreter with
CHECKOUT as working directory and ``PYTHONPATH`` (default bundles: ``fixtures/bundles/*``), two
at a time, and keeps the exit code. ``compare`` normalises what varies from run to run (the
``timings``, the paths of the report and of the checkout: a source line shown relative to the
working directory) and diffs report.json,
report.md, every repro script, and the tensors of every repro's ``inputs.safetensors`` bit for
bit. Exit 1 when anything differs.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def collect(root: Path, out: Path, bundles: list[Path]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / ".root").write_text(str(root))     # the checkout's paths are normalised away

    def one(b: Path) -> str:
        dest = out / b.name
        p = subprocess.run([sys.executable, "-m", "nanbisect", "run", str(b), "--out",
                            str(dest)], cwd=str(root), capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(root)})
        (out / f"{b.name}.exit").write_text(f"{p.returncode}\n{p.stderr[-2000:]}")
        return f"{b.name}: exit {p.returncode}"

    with ThreadPoolExecutor(2) as pool:
        for line in pool.map(one, bundles):
            print(line, file=sys.stderr)


def _norm(text: str, names: list[str]) -> str:
    for n in names:
        text = text.replace(n, "" if n.endswith(os.sep) else "<PATH>")
    return re.sub(r"/tmp/[^\s\"']*", "<TMP>", text)


def _json(path: Path, names: list[str]) -> str:
    data = json.loads(path.read_text())
    data.pop("timings", None)
    if path.name == ".nanbisect-report":     # hashes of files compared one by one here
        data.pop("files", None)
    return _norm(json.dumps(data, indent=1, sort_keys=True), names)


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def compare(a: Path, b: Path) -> int:
    import torch

    bad = 0
    names = sorted({e.stem for e in a.glob("*.exit")} & {e.stem for e in b.glob("*.exit")})
    for name in names:
        exit_a = a / f"{name}.exit"
        ea = exit_a.read_text().split("\n", 1)[0]
        eb = (b / f"{name}.exit").read_text().split("\n", 1)[0]
        diffs = [] if ea == eb else [f"exit {ea} != {eb}"]
        da, db = a / name, b / name
        names_a, names_b = [str(da), str(a)], [str(db), str(b)]
        roots = [(d / ".root").read_text() + os.sep for d in (a, b) if (d / ".root").exists()]
        names_a, names_b = names_a + roots, names_b + roots
        files = sorted({p.relative_to(da) for p in da.rglob("*") if p.is_file()}
                       | {p.relative_to(db) for p in db.rglob("*") if p.is_file()})
        for rel in files:
            pa, pb = da / rel, db / rel
            if not pa.exists() or not pb.exists():
                diffs.append(f"{rel}: only in {'before' if pa.exists() else 'after'}")
                continue
            if rel.suffix == ".safetensors":
                ta, tb = _tensors(pa), _tensors(pb)
                if ta.keys() != tb.keys() or any(
                        ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape
                        or not torch.equal(ta[k].view(-1).view(torch.uint8),
                                           tb[k].view(-1).view(torch.uint8)) for k in ta):
                    diffs.append(f"{rel}: tensors differ")
                continue
            if rel.suffix == ".html":
                continue    # rendered from report.json, with the timings
            as_json = rel.suffix == ".json" or rel.name == ".nanbisect-report"
            ta = _json(pa, names_a) if as_json else _norm(pa.read_text(), names_a)
            tb = _json(pb, names_b) if as_json else _norm(pb.read_text(), names_b)
            if ta != tb:
                diffs.append(f"{rel}:\n" + "".join(list(difflib.unified_diff(
                    ta.splitlines(True), tb.splitlines(True), "before", "after"))[:60]))
        print(f"{name}: {'same' if not diffs else 'DIFFERENT'}")
        for d in diffs:
            print("   " + d)
        bad += bool(diffs)
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--root", type=Path, default=ROOT)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("bundles", nargs="*", type=Path)
    d = sub.add_parser("compare")
    d.add_argument("a", type=Path)
    d.add_argument("b", type=Path)
    args = ap.parse_args()
    if args.cmd == "collect":
        bundles = [p.resolve() for p in args.bundles] or sorted(
            p for p in (args.root / "fixtures" / "bundles").iterdir() if p.is_dir())
        collect(args.root.resolve(), args.out.resolve(), bundles)
    else:
        sys.exit(compare(args.a, args.b))


if __name__ == "__main__":
    main()
