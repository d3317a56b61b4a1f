"""What many test files share (conftest.py keeps only pytest's fixtures and hooks): where the
suite's files are (`paths`), running the CLI and Python programs (`run`), file helpers (`files`);
multi-rank captures shared by the session (`bundles`), tmpfs and read-only mounts (`mounts`), what
a Guard holds and when it snapshots (`held`), the per-file progress line (`progress`)."""
from helpers.files import aged, tree_digest
from helpers.marks import same_run
from helpers.paths import FIXTURES, ROOT, TASKS, TEST_TASKS
from helpers.run import (CliResult, Started, cli, invoke, one_line_exit_2, run_json, run_python,
                         start_python)

__all__ = ["FIXTURES", "ROOT", "TASKS", "TEST_TASKS", "CliResult", "Started", "aged", "cli",
           "invoke", "one_line_exit_2", "run_json", "run_python", "same_run", "start_python",
           "tree_digest"]
