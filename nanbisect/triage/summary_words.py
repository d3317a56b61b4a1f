"""The exit codes of a triage run and what each says (shared by the summary and the index)."""
from __future__ import annotations

EXIT_CLEAN, EXIT_KNOWN, EXIT_ERRORS, EXIT_NEW = 0, 1, 2, 3
EXIT_MEANING = {EXIT_CLEAN: "every bundle replayed clean",
                EXIT_KNOWN: "failures, all with signatures --known lists",
                EXIT_ERRORS: "no new signature, but some bundle could not be triaged",
                EXIT_NEW: "at least one signature --known does not list (every one, without "
                          "--known)"}
