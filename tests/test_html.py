"""report.html: self-contained, its plot marks the culprit; a real browser renders it."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import cli

RED, BLUE = (214, 39, 40), (31, 119, 180)


def _report(fixture_bundle):
    bundle = fixture_bundle("forward_nan_behind_mask")
    assert cli("run", "--ckpt", bundle).code == 1
    return bundle / "nanbisect-report" / "report.html"


def test_html_is_self_contained_with_plot(fixture_bundle):
    page = _report(fixture_bundle).read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page
    assert "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    assert "culprit: blocks.1.mlp.act (call 2)" in page
    assert page.count('fill="#d62728"><title>') >= 5       # NaN bars from the culprit on


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium not installed")
def test_browser_renders_the_plot(fixture_bundle, tmp_path):
    from PIL import Image

    page = _report(fixture_bundle)
    png = tmp_path / "shot.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,700",
                    f"--screenshot={png}", page.as_uri()], capture_output=True, timeout=120)
    img = Image.open(png).convert("RGB")
    seen = {colour: n for n, colour in img.getcolors(maxcolors=1 << 24)}
    counts = {RED: seen.get(RED, 0), BLUE: seen.get(BLUE, 0)}
    assert counts[RED] > 500, counts      # the NaN bars were drawn
    assert counts[BLUE] > 50, counts      # the culprit marker was drawn
