"""The records that cross stages: frozen dataclasses with typed fields, in one package (a module
per family; every name is importable from here).

What a replay saw (`StepOutcome`, `BadValue`, `Stats`), where the failure was born (`CallId`,
`Culprit`, `OpSite`, `OpFinding`, `OpRef`, `ContextRow`), what a narrow replay caught for the
repro (`Caught`, `ModuleCaught`) and what running it said (`ReproResult`), what replaying the
step with a change gave (`Remedy`) and which batch rows the failure depends on (`RowTrace`),
what the reference said (`Comparison`, `OpCheck`, `Divergence`), the facts every report shares
(`Losses`, `RunFacts`), a stage after the verdict that failed (`StageError`), and the protocol
between the multi-rank launcher and its rank workers (`Bucket`, `RankSummary`, `RankRoot`,
`Plan`, `RankResult`). Records that become JSON say how, in ``to_json`` (written with the one
encoder, `nanbisect.util.recordjson`: non-finite floats as "nan", "inf", "-inf"); those that
come back from JSON (the rank workers' results, and every part of a report.json:
`nanbisect.report.model.Report.from_json`) have ``from_json``, which reads those strings back
as floats where the field is a number. `Culprit` has a constructor per way a stage knows its
culprit (`Culprit.phase_only`, `of_call`, `of_tensors`, `of_parameter`, `of_root`,
`of_finding`).

Guarantees: importing this module imports no torch; nothing here computes on tensors (records
that hold tensors only carry them).
"""
from __future__ import annotations

from nanbisect.records.compiler import CompilerFinding
from nanbisect.records.compared import Comparison, Divergence, OpCheck
from nanbisect.records.culprit import (Caught, ContextRow, Culprit, ModuleCaught, ModuleRepro,
                                       Node, OpFinding, OpRecording, OpRef, OpSite, ReproResult,
                                       TimelineRow, TraceRow)
from nanbisect.records.facts import (Fidelity, Finding, HistoryEntry, Losses, RunFacts,
                                     StageError, StepRow, StepsWindow, after_verdict,
                                     fidelity_tier)
from nanbisect.records.remedies import Remedy, RowTrace
from nanbisect.records.ranks import (Bucket, Crossing, Plan, RankPath, RankReference, RankResult,
                                     RankRoot, RankSummary, ReplicaDiff, Subset)
from nanbisect.records.seen import BadValue, CallId, Stats, StepOutcome, before_the_step
from nanbisect.records.words import ROOT, Classification, Verdict, Word, json_number, module_label

__all__ = ["json_number", "Word", "Verdict", "Classification", "ROOT", "module_label", "CallId",
           "Stats", "BadValue", "StepOutcome", "before_the_step", "Culprit", "TraceRow",
           "TimelineRow", "OpSite",
           "OpRef", "ContextRow", "OpFinding", "OpRecording", "Caught", "ModuleCaught",
           "ReproResult", "ModuleRepro", "Comparison", "OpCheck", "Divergence", "Losses",
           "Fidelity", "RunFacts", "HistoryEntry", "Finding", "StepRow", "StepsWindow", "Bucket",
           "RankSummary", "RankRoot", "Plan", "RankReference", "ReplicaDiff", "Subset", "Crossing",
           "RankPath",
           "RankResult", "fidelity_tier", "Remedy", "RowTrace", "CompilerFinding", "StageError",
           "after_verdict", "Node"]
