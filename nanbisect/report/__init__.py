"""What a run says: the report record (`model`), its text (`text`: headline, markdown, terminal)
and page (`page`: report.html), the report directory (`write`) and the standalone repro
(`repro`, rendered from `templates/`).

Shared between its modules: `out` (where a report may go; light, the command line calls it
before torch is imported) gives `write` `files_under` (every entry under a directory) and
`inside` (a path at or under another)."""
