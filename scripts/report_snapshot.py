"""Replay every shipped fixture bundle and keep its report.json/report.md, normalised, so that two
checkouts can be compared byte for byte (a restructure must not change a single report).

    python scripts/report_snapshot.py OUT_DIR            # this checkout
    PYTHONPATH=/other/checkout python scripts/report_snapshot.py OUT_DIR
    diff -r BEFORE_DIR AFTER_DIR
    python scripts/report_snapshot.py --gallery docs/gallery   # the README's screenshots

Each bundle runs twice, with default flags and with `--reference cpu`, as a real `nanbisect run`
subprocess into a temporary --out. Normalised: `timings` (seconds differ run to run) and the
temporary output paths (replaced by `<OUT>`); the repo root becomes `<REPO>`.

`--gallery DIR` renders what the README shows instead: report.html of the shipped
forward_nan_behind_mask bundle at 1280 and 400 px wide (`report-html.png`,
`report-html-400.png`, the whole page) and the index of a small triage night
(`triage-index.png`: three fixture bundles and a corrupted one, triaged twice so the second
night says what is new), in headless Chromium. Everything runs in a temporary directory with
relative paths; an absolute path left in a page is replaced by its last parts before the
screenshot (and the script fails if one remains), so no screenshot shows the machine it was
made on.
"""
from __future__ import annotations

import json
import os
import re
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


GALLERY_NIGHT = {"job-17/step000000": "forward_nan_behind_mask",
                 "job-17-retry/step000000": "forward_nan_behind_mask",
                 "job-23/step000000": "backward_nan_custom_function",
                 "job-31/step000003": "nan_batch", "job-40/step000003": "healthy"}


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        raise SystemExit("report_snapshot: --gallery needs headless Chromium (`chromium` on "
                         "PATH; apt-get install chromium)")
    return found


def _page_height(page: Path, width: int, tmp: Path) -> int:
    """The page's full height at ``width`` (a harness iframe measured by the browser)."""
    harness = page.parent / ".height.html"
    harness.write_text(f'<!doctype html><iframe id="f" src="{page.name}" style="width:{width}px;'
                       'height:600px;border:0"></iframe><pre id="h">?</pre><script>'
                       'addEventListener("load",()=>{document.getElementById("h").textContent='
                       'document.getElementById("f").contentDocument.documentElement'
                       '.scrollHeight})</script>')
    dom = subprocess.run([_chromium(), *_FLAGS, f"--user-data-dir={tmp / 'profile'}",
                          "--allow-file-access-from-files", "--dump-dom", harness.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    harness.unlink()
    found = re.search(r'<pre id="h">(\d+)</pre>', dom)
    return min(int(found.group(1)), 8000) if found else 2400


_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
          "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _shoot(page: Path, width: int, png: Path, tmp: Path) -> None:
    from PIL import Image

    height = _page_height(page, width, tmp)
    subprocess.run([_chromium(), *_FLAGS, f"--user-data-dir={tmp / 'profile'}",
                    f"--window-size={width},{height}", f"--screenshot={png}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    # 256 colours, the plots' own among them (an adaptive palette alone merges the inf bars'
    # orange into the NaN red): a third of the bytes, no visible difference
    img = Image.open(png).convert("RGB")
    n = 256 - len(_KEY_COLOURS)
    base = img.quantize(n, method=Image.Quantize.FASTOCTREE).getpalette()[:3 * n]
    palette = Image.new("P", (1, 1))
    palette.putpalette([v for c in _KEY_COLOURS for v in c] + base)
    img.quantize(palette=palette, dither=Image.Dither.NONE).save(png, optimize=True)


_KEY_COLOURS = [(214, 39, 40), (255, 127, 14), (44, 160, 44), (31, 119, 180), (253, 232, 232),
                (230, 244, 230), (127, 127, 127)]


def _relative(page: Path, roots: list[Path]) -> Path:
    """``page`` with every absolute path under ``roots`` made relative (what it shows)."""
    text = page.read_text()
    for root in roots:
        text = text.replace(str(root) + "/", "").replace(str(root), ".")
    left = re.findall(r"(?:/tmp|/home|/root|/work|/Users)/[\w./-]+", text)
    if left:
        raise SystemExit(f"report_snapshot: {page.name} still shows absolute paths: {left[:3]}")
    page.write_text(text)
    return page


def gallery(dest: Path) -> int:
    """The README's screenshots, made in a temporary directory with relative paths."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t).resolve()
        (tmp / "fixtures").symlink_to(REPO / "fixtures")     # the entries' relative paths
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        run = [sys.executable, "-m", "nanbisect"]
        subprocess.run([*run, "run", "fixtures/bundles/forward_nan_behind_mask", "--out",
                        "report"], cwd=tmp, env=env, capture_output=True, timeout=900)
        page = _relative(tmp / "report" / "report.html", [tmp, REPO])
        for width, name in ((1280, "report-html.png"), (400, "report-html-400.png")):
            _shoot(page, width, dest / name, tmp)
            print(name, flush=True)
        night = tmp / "night"
        for where, name in GALLERY_NIGHT.items():
            shutil.copytree(REPO / "fixtures" / "bundles" / name, night / where,
                            ignore=shutil.ignore_patterns("nanbisect-report"))
        (night / "job-40" / "step000003" / "model.safetensors").write_bytes(b"truncated")
        # two nights: the second says which signatures are new since the first
        first = {k: v for k, v in GALLERY_NIGHT.items() if v != "backward_nan_custom_function"}
        hidden = tmp / "later"
        for where in set(GALLERY_NIGHT) - set(first):
            (hidden / where).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(night / where, hidden / where)
        subprocess.run([*run, "triage", "night", "--out", "triage"], cwd=tmp, env=env,
                       capture_output=True, timeout=1800)
        for where in set(GALLERY_NIGHT) - set(first):
            shutil.move(hidden / where, night / where)
        subprocess.run([*run, "triage", "night", "--out", "triage"], cwd=tmp, env=env,
                       capture_output=True, timeout=1800)
        index = _relative(tmp / "triage" / "index.html", [tmp, REPO])
        _shoot(index, 1280, dest / "triage-index.png", tmp)
        print("triage-index.png", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--gallery":
        return gallery(Path(argv[1]).resolve())
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
