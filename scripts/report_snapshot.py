"""Replay every shipped fixture bundle and keep its report.json/report.md, normalised, so that two
checkouts can be compared byte for byte (a restructure must not change a single report).

    python scripts/report_snapshot.py OUT_DIR            # this checkout
    PYTHONPATH=/other/checkout python scripts/report_snapshot.py OUT_DIR
    diff -r BEFORE_DIR AFTER_DIR

Each bundle runs twice, with default flags and with `--reference cpu`, as a real `nanbisect run`
subprocess into a temporary --out. Normalised: `timings` (seconds differ run to run) and the
temporary output paths (replaced by `<OUT>`); the repo root becomes `<REPO>`.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAGS = {"default": [], "reference-cpu": ["--reference", "cpu"]}


def _normalise(text: str, out: Path) -> str:
    return text.replace(str(out), "<OUT>").replace(str(REPO), "<REPO>")


def _snapshot_one(bundle: Path, flags: list[str], dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report"
        proc = subprocess.run(
            [sys.executable, "-m", "nanbisect", "run", str(bundle), "--out", str(out), *flags],
            cwd=REPO, capture_output=True, text=True, timeout=600)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "exit_code").write_text(f"{proc.returncode}\n")
        (dest / "stdout").write_text(_normalise(proc.stdout, out))
        if (out / "report.json").exists():
            data = json.loads((out / "report.json").read_text())
            data.pop("timings", None)
            text = json.dumps(data, indent=1, sort_keys=True)
            (dest / "report.json").write_text(_normalise(text, out) + "\n")
        if (out / "report.md").exists():
            (dest / "report.md").write_text(_normalise((out / "report.md").read_text(), out))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    dest = Path(argv[0]).resolve()
    if dest.exists():
        shutil.rmtree(dest)
    bundles = sorted(p for p in (REPO / "fixtures" / "bundles").iterdir()
                     if (p / "manifest.json").exists())
    for bundle in bundles:
        for name, flags in FLAGS.items():
            _snapshot_one(bundle, flags, dest / bundle.name / name)
            code = (dest / bundle.name / name / "exit_code").read_text().strip()
            print(f"{bundle.name:32s} {name:14s} exit {code}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
