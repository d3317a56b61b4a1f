"""report.html: a self-contained page (no script, no external file): the culprit card first,
target and reference side by side, the ops before the culprit and the module calls around it as
tables, a plot of per-module-call NaN/inf counts and abs-max along the step's execution order
(the culprit marked), the step history, the notes; report.md and report.json folded at the end.

The plots are inline SVG (`nanbisect.report.plots`): bars are the NaN (red) and inf (orange)
counts of each module call's output (forward) or outgoing gradient (backward), on a log scale;
the line is the largest finite magnitude, on its own log scale; a dashed line marks the culprit
call. Each is drawn wide and narrow; the page's CSS shows the one that fits the window.
"""
from __future__ import annotations

import functools
from importlib.resources import files

from nanbisect.records import StageError, after_verdict, module_label
from nanbisect.report.model import Report
from nanbisect.report.plots import both, history_svg, plot_svg
from nanbisect.report.prose import (LOSS_FN_WHAT, fidelity_text, headline, in_loss_fn, module_cell,
                                   remedy_detail, rows_text, to_markdown, verified)
from nanbisect.util.recordjson import dumps
from nanbisect.util.spec import NONE


def history_marks(r: Report) -> list[tuple[int, str]]:
    """The steps the history plot marks besides the failing one: those the findings name, and
    the first divergent step of a --steps window."""
    marks = [(f.step, f.kind) for f in r.history_findings if f.step is not None]
    if r.steps and r.steps.first_divergent_step is not None:
        marks.append((r.steps.first_divergent_step, "first divergent step"))
    return marks


# what each classification means, in one line (docs/explanations/classifications.md at length)
MEANING = {
    "device": "the culprit op, given the same inputs at the same dtype, is wrong on the target "
              "and right on the reference",
    "numerics": "the failure follows from the arithmetic at this dtype: it happens on a "
                "correct device too",
    "data": "the batch or a loaded state already held the non-finite value",
    "communication": "every rank's input to a collective was finite and its output was not",
    "transient": "the failure did not come back on a faithful replay of the captured step",
    "code-changed": "the code differs from the capture's: the edit is the first suspect",
    "replay-mismatch": "the replay does not compute the captured step; no verdict about the "
                       "device follows",
    "compiler": "the failure comes back with the model compiled and not eagerly, from the same "
                "state, batch and RNG: the compiler's transformation made it",
    "unknown": "not enough evidence (no reference, an op the reference cannot run, or another "
               "device or machine than the capture's)",
}


def _num(v) -> str:
    """A number in a cell: ``-`` for none; a non-finite one as ``nan``, ``inf``, ``-inf``."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, ".4g")
    return str(v)


@functools.lru_cache(maxsize=1)
def page_template():
    """The page's jinja2 template, compiled once per process (0.1 s of CPU; a fork server
    compiles it before it forks: `nanbisect.pipeline.run.warm_fork_server`)."""
    from jinja2 import Environment, StrictUndefined

    env = Environment(autoescape=True, undefined=StrictUndefined, trim_blocks=True,
                      lstrip_blocks=True, keep_trailing_newline=True)
    env.globals.update(num=_num, dash=lambda v: "-" if v is None else v,
                       label=module_label, remedy_detail=remedy_detail, cell=module_cell,
                       in_loss_fn=in_loss_fn, loss_fn_what=LOSS_FN_WHAT)
    return env.from_string(
        (files("nanbisect.report") / "templates" / "report.html.j2").read_text())


def _plot(failed: list[StageError] | None, draw, *args) -> str:
    """Both drawings of a plot; with ``failed`` a plot that raises is a line saying so, listed
    there (stage ``plots``)."""
    if failed is None:
        return both(draw, *args)
    return after_verdict(failed, "plots", lambda: both(draw, *args),
                         "<p>(this plot could not be drawn: see the errors)</p>")


def to_html(r: Report, failed: list[StageError] | None = None,
            report_json: str | None = None) -> str:
    """The page for ``r``: the culprit card first, the errors of stages that failed, target
    and reference side by side, the ops and module calls as tables, the plots, the notes;
    self-contained (no script, no network), readable in a narrow window and printable
    (`templates/report.html.j2`). With ``failed``, a plot that raises is left out and listed
    there (`nanbisect.report.write.render` adds it to the report's errors); ``report_json``:
    the report.json text folded in at the end (default: made from ``r``)."""
    c = r.culprit if r.verdict == "culprit" else None
    if c is not None and r.subset and not r.subset.decided and r.subset.next_ranks:
        c = None     # a rank that was not replayed: the headline says which to replay next
    culprit = (c.module, c.module_call) if c else None
    template = page_template()
    res = r.repro_result
    said = ("not run" if res is None or not res.ran else
            "reproduced" if res.reproduced else "did not reproduce")
    forward = r.failed_phase == "forward"
    roles = {(t.module, t.call): "propagator" for t in r.timeline if t.came_in_bad}
    roles.update({(t.module, t.call): t.role for t in r.backtrace})   # what the plot marks passed
    return template.render(
        r=r, c=c, headline=headline(r), meaning=MEANING.get(r.classification or ""),
        multi=bool(r.ranks), has_reference=r.facts.reference not in (None, NONE),
        losses=r.facts.losses, repro_said=f"{said} on {r.facts.target}",
        fidelity=fidelity_text(r),
        side_in="inputs" if forward else "grad arriving",
        side_out="output" if forward else "grad leaving",
        timeline_svg=_plot(failed, functools.partial(plot_svg, roles=roles), r.timeline,
                           culprit, r.failed_phase or ""),
        # NaN/inf counts along the step: only where some call had any (not for a divergence)
        show_timeline=any(t.nan or t.inf for t in r.timeline),
        history_svg=_plot(failed, history_svg, list(r.history or []), history_marks(r)),
        markdown=to_markdown(r),
        verified=verified(r), tried=[m for m in r.remedies if m.outcome in ("still-failing",
                                                                           "error")],
        rows_ids=next((rows_text(m) for m in r.remedies if m.kind == "samples"
                       and rows_text(m)), ""),
        report_json=report_json if report_json is not None else dumps(r.to_json(), indent=1))
