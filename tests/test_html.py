"""report.html: self-contained, answers at a glance (the culprit card first, tables, a plot with
axis values and a readable culprit label, the history when there is one); a real headless
Chromium renders it."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from conftest import cli

RED, BLUE = (214, 39, 40), (31, 119, 180)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed")


def _report(fixture_bundle):
    bundle = fixture_bundle("forward_nan_behind_mask")
    assert cli("run", "--ckpt", bundle).code == 1
    return bundle / "nanbisect-report" / "report.html"


def _chromium(tmp_path, *args):
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--disable-quic", "--no-first-run", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120)


def test_html_is_self_contained_and_leads_with_the_culprit(fixture_bundle):
    page = _report(fixture_bundle).read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page
    assert "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    card = page.index('class="culprit-card"')
    assert card < page.index("<svg") and card < page.index("Ops up to the culprit")
    head = page[card:page.index("</table>", card)]
    for text in ("aten.sqrt.default", "blocks.1.mlp.act", "call 2", "forward",
                 "fixtures/tasks/forward_nan_behind_mask.py:24", "float32[4, 12, 128]",
                 "unknown", "not enough evidence"):
        assert text in head, text
    assert "culprit: blocks.1.mlp.act (call 2)" in page
    assert page.count('fill="#d62728"><title>') >= 5       # NaN bars from the culprit on
    assert page.count('class="tick"') >= 8                 # both y axes and the x axis have values
    assert "None" not in re.sub(r"<details>.*</details>", "", page, flags=re.S)
    # the ops before the culprit and the module calls are tables, not text in a <pre>
    assert re.search(r"<tr class=\"hit\"><td>224</td><td><code>aten.sqrt.default", page)
    assert "<td>propagator</td>" in page


@needs_browser
def test_browser_renders_the_page(fixture_bundle, tmp_path):
    from PIL import Image

    page = _report(fixture_bundle)
    png = tmp_path / "shot.png"
    _chromium(tmp_path, "--window-size=1000,1800", f"--screenshot={png}", page.as_uri())
    img = Image.open(png).convert("RGB")
    seen = {colour: n for n, colour in img.getcolors(maxcolors=1 << 24)}
    counts = {RED: seen.get(RED, 0), BLUE: seen.get(BLUE, 0)}
    assert counts[RED] > 500, counts      # the NaN bars (and the card's frame) were drawn
    assert counts[BLUE] > 50, counts      # the culprit marker was drawn
    assert len(seen) > 50                 # not blank: text, tables and plot in many shades
    # the DOM as the browser built it: the culprit table and the axis ticks are there
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    assert '<table class="culprit-card">' in dom and dom.count('class="tick"') >= 8
    assert "aten.sqrt.default" in dom


@needs_browser
def test_narrow_window_keeps_the_culprit_readable(fixture_bundle, tmp_path):
    """A phone-width window: the page reflows (no horizontal scroll of the whole page), the
    culprit card is still first."""
    from PIL import Image

    page = _report(fixture_bundle)
    png = tmp_path / "narrow.png"
    _chromium(tmp_path, "--window-size=420,900", f"--screenshot={png}", page.as_uri())
    img = Image.open(png).convert("RGB")
    top = img.crop((0, 0, img.width, 400))
    reds = sum(n for n, c in top.getcolors(maxcolors=1 << 24) if c == RED)
    assert reds > 200      # the verdict badge and the card's red frame within the first screen
