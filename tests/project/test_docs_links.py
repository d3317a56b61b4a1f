"""The documents hold together: every relative link and anchor in README.md, CHANGELOG.md and
docs/ resolves, the README stays a front page (at most 250 lines, its first block the two
commands), the reference's table of numbers is the code's, and the user documents carry no
issue numbers, work-log notes or paths outside the repository. Pure text: no torch, no child
process."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from helpers import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
# what a user reads to use nanbisect (issue numbers live in CHANGELOG.md only)
USER_DOCS = [README, DOCS / "README.md", DOCS / "BENCHMARKS.md",
             *sorted((DOCS / "guide").glob("*.md")), *sorted((DOCS / "reference").glob("*.md")),
             *sorted((DOCS / "explanations").glob("*.md"))]
ALL_DOCS = sorted({README, ROOT / "CHANGELOG.md", *DOCS.rglob("*.md")})
MAX_README_LINES = 250

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
WORK_LOG = [
    (re.compile(r"\bissues?\s+#?\d+", re.I), "an issue number"),
    (re.compile(r"\bthis stop\b", re.I), "a work-log 'this stop'"),
    (re.compile(r"(?<![\w.])(/work/|/tmp/d2|\.\./shared/)"), "a path outside the repository"),
]


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (links and headings there are
    examples, not structure)."""
    text = FENCE.sub("", text)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.

    >>> slug("What to do next, verified: remedies (`remedies`, `culprit.samples`)")
    'what-to-do-next-verified-remedies-remedies-culpritsamples'
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)       # a link's text only
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, repeated headings numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``path`` whose file, folder or anchor does not exist, or that
    leave ``root``."""
    bad = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):         # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading with that anchor)")
        elif not dest.resolve().is_relative_to(root.resolve()):
            bad.append(f"{target} (outside the repository)")
    return bad


@pytest.mark.parametrize("path", ALL_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert not broken_links(path), f"{path.relative_to(ROOT)}: {broken_links(path)}"


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_documents_carry_no_work_log(path):
    """Issue numbers, "this stop" and the development machine's paths belong in CHANGELOG.md."""
    text = path.read_text()
    found = [f"line {text[:m.start()].count(chr(10)) + 1}: {what} ({m.group(0)!r})"
             for pattern, what in WORK_LOG for m in pattern.finditer(text)]
    assert not found, f"{path.relative_to(ROOT)}: {found}"


def test_the_readme_is_a_front_page():
    """At most 250 lines, and its first fenced block is exactly the two commands a fresh clone
    runs (the fresh-clone check runs that block's lines)."""
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES, len(text.splitlines())
    first = re.search(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S).group(1)
    assert first.split("\n")[:-1] == ["bash scripts/demo.sh", "bash scripts/test.sh"], first


def test_the_readme_links_every_guide_reference_and_explanation():
    """Each page of docs/guide, docs/reference and docs/explanations is one click from the
    README, so nothing moved out of it is lost from view."""
    linked = {(README.parent / t.partition("#")[0]).resolve()
              for t in LINK.findall(_prose(README.read_text()))}
    pages = [p for p in USER_DOCS if p.parent.name in ("guide", "reference", "explanations")]
    missing = [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in linked]
    assert not missing, missing


def test_the_reference_documents_every_number():
    """docs/reference/environment.md holds `table()`: a range changed in code and not in the
    docs fails."""
    from nanbisect.util.numbers import table
    assert table() in (DOCS / "reference" / "environment.md").read_text()


def test_the_link_checker_sees_a_broken_link(tmp_path):
    """The checker itself: a missing file and a missing anchor are found, code is skipped."""
    (tmp_path / "a.md").write_text("# Title\n\n[ok](#title) [gone](b.md) [no](#nowhere)\n"
                                   "`[code](c.md)`\n```\n[fenced](d.md)\n```\n")
    assert broken_links(tmp_path / "a.md", tmp_path) == ["b.md (no such file)",
                                                         "#nowhere (no heading with that anchor)"]
