"""Where the suite's files are: the repository, its shipped bundles and tasks, the tests' own
task modules."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "bundles"
TASKS = ROOT / "fixtures" / "tasks"
TEST_TASKS = ROOT / "tests" / "tasks"
