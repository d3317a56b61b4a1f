"""The exit codes of a triage run and what each says, and the count of what became of the
bundles: the words the summary (triage.md) and the index (index.html) share."""
from __future__ import annotations

EXIT_CLEAN, EXIT_KNOWN, EXIT_ERRORS, EXIT_NEW = 0, 1, 2, 3
EXIT_MEANING = {EXIT_CLEAN: "every bundle replayed clean",
                EXIT_KNOWN: "failures, all with signatures --known lists",
                EXIT_ERRORS: "no new signature, but some bundle could not be triaged (or its "
                             "report could not be written)",
                EXIT_NEW: "at least one signature --known does not list (every one, without "
                          "--known)"}


def counts_text(data: dict) -> str:
    """How many bundles were found and what became of them, every one counted once.

    >>> counts_text({"bundles": [{"bundle": "a"}], "errors": [{"bundle": "b"}],
    ...              "pending": [], "signatures": [{"signature": "x"}]})
    '2 bundle(s): 1 replayed, 1 error(s); 1 signature(s)'
    """
    done, errors, pending = len(data["bundles"]), len(data["errors"]), len(data.get("pending")
                                                                            or [])
    parts = [f"{done} replayed", f"{errors} error(s)"] + ([f"{pending} pending"] if pending
                                                          else [])
    return (f"{done + errors + pending} bundle(s): {', '.join(parts)}; "
            f"{len(data['signatures'])} signature(s)")
