"""What a run says: the report record (`model`), its text (`text`: headline, markdown, terminal)
and page (`page`: report.html), the report directory (`write`) and the standalone repro
(`repro`, rendered from `templates/`)."""
