"""Stage 0: the one supervisor of child processes. Every child nanbisect starts goes through here.

- start: `fork` (this process, torch loaded), `from_server` / `ForkServer` (a fork server that
  imported torch once), `start_exec` (a fresh interpreter or program);
- bound and end: `finish` (a deadline; past it the child's process group is killed and it is
  reaped), `stop` and `reaped` (killed and reaped on every path, interrupts included), `held`
  around a fork;
- what the child said: `Output`;
- end with the starter, from inside the child: `guard_group` (a pipe guardian and
  ``PR_SET_PDEATHSIG``), `exit_when_free` (the starter's lock let go);
- scratch: `locked` (a directory whose lock tells whether its owner lives), `sweep` (what dead
  owners left), `watched` (a janitor kills every process naming it when its owner dies),
  `kill_named`.

Guarantees: imports only the standard library and `nanbisect.util` (no torch), so that every
stage may use it. Not guaranteed: what a child runs; its starter decides that.
"""
from nanbisect.proc.child import end_child, import_env, preload, run_main, run_target
from nanbisect.proc.forkserver import Child, ForkServer, serve, warm_name
from nanbisect.proc.guard import exit_when_free, guard_group
from nanbisect.proc.reap import Handle, finish, reaped, stop
from nanbisect.proc.scratch import kill_named, locked, processes_naming, sweep, watched
from nanbisect.proc.signals import held, unheld
from nanbisect.proc.supervisor import Forked, Output, fork, from_server, start_exec

__all__ = ["Child", "ForkServer", "Forked", "Handle", "Output", "end_child", "exit_when_free",
           "finish", "fork", "from_server", "guard_group", "held", "import_env", "kill_named",
           "locked", "preload", "processes_naming", "reaped", "run_main", "run_target", "serve",
           "start_exec", "stop", "sweep", "unheld", "warm_name", "watched"]
