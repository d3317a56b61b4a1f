"""``OUT/index.html``: the night at a glance, for a browser: the signatures (count, new since
the last night, known, the remedy that made the step finite), every bundle with a link to its
report.html (``OUT/reports/NAME/``), the errors and what was skipped.

Guarantees: self-contained (no script, no network), links relative to ``OUT`` (the directory
can be moved or served as it is), rewritten with triage.json each time (`summary.NightState.write`).
Not guaranteed: links of reports kept outside ``OUT`` (a cluster's worker that did not see it:
those rows have no link).
"""
from __future__ import annotations

from importlib.resources import files

from nanbisect.nightly.summary_words import EXIT_MEANING, counts_text


def to_html(data: dict) -> str:
    """The index page of a triage summary ``data`` (triage.json's content)."""
    from jinja2 import Environment, StrictUndefined

    env = Environment(autoescape=True, undefined=StrictUndefined, trim_blocks=True,
                      lstrip_blocks=True, keep_trailing_newline=True)
    template = env.from_string(
        (files("nanbisect.nightly") / "templates" / "index.html.j2").read_text())
    reports = {b["bundle"]: b.get("report_dir") for b in data["bundles"]}
    return template.render(d=data, counts=counts_text(data), reports=reports,
                           meaning=EXIT_MEANING.get(data["exit_code"], ""))
