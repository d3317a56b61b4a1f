"""Stage 0: the one supervisor of child processes. Every child nanbisect starts goes through here.

- one handle for a process or a group (`Processes`, in the manner of torch elastic's
  ``PContext``): start (fork, exec, or a child started below), poll, wait with a deadline, stop
  with grace (SIGTERM, then SIGKILL), reap, and what each child said;
- start: `fork` (this process, torch loaded), `from_server` / `ForkServer` (a fork server that
  imported torch once), `start_exec` (a fresh interpreter or program); `Waiting` (a fresh
  interpreter started ahead that waits for one line saying what to run) and `Spares` (the pool
  that keeps one for the next taker, ended at exit when nobody took it);
- bound and end one child: `finish` (a deadline; past it the child's process group is killed
  and it is reaped), `stop` and `reaped` (killed and reaped on every path, interrupts
  included), `held` around a fork; `signal_child` (a signal to a child, its group where it leads
  one), `signal_pid` (to a process nanbisect did not start itself: a rank found by its pid);
- signal handlers: `install`, `handling` (set, then put back), `deferred` (a signal held back
  for a block, then delivered), `imports_whole` (a Ctrl-C held while an import is under way);
- what the child said: `Output`;
- the lifeline, from inside the child: `guard_group` (a pipe guardian and
  ``PR_SET_PDEATHSIG``), `exit_when_free` (the starter's lock let go), `exit_when_orphaned`
  (the parent gone: this process's children killed, then it ends);
- scratch: `locked` (a directory whose lock tells whether its owner lives), `sweep` (what dead
  owners left), `watched` (a janitor kills every process naming it when its owner dies),
  `kill_named`.

The package's internal interface (what its modules share, not for other stages):
`reap.settled` (one step of a cleanup that never raises, retried when an interrupt cuts it
short; `forkserver` cleans up an unwanted child with it).

Guarantees: imports only the standard library and `nanbisect.util` (no torch at import; a
forked child's exit, where torch is loaded already, goes through `util.torch_internals`), so
that every stage may use it. Not guaranteed: what a child runs; its starter decides that.
"""
from nanbisect.proc.child import end_child, import_env, preload, run_main, run_target
from nanbisect.proc.forkserver import Child, ForkServer, serve, warm_name
from nanbisect.proc.interpreters import Spares, Waiting
from nanbisect.proc.lifeline import exit_when_free, exit_when_orphaned, guard_group
from nanbisect.proc.processes import Processes
from nanbisect.proc.reap import Handle, finish, reaped, signal_child, signal_pid, stop
from nanbisect.proc.scratch import kill_named, locked, processes_naming, sweep, watched
from nanbisect.proc.signals import deferred, handling, held, imports_whole, install, unheld
from nanbisect.proc.supervisor import Forked, Output, fork, from_server, start_exec

__all__ = ["Child", "ForkServer", "Forked", "Handle", "Output", "Processes", "Spares", "Waiting",
           "deferred",
           "end_child", "exit_when_free", "exit_when_orphaned", "finish", "fork", "from_server",
           "guard_group", "handling", "held", "import_env", "imports_whole", "install",
           "kill_named", "locked",
           "preload", "processes_naming", "reaped", "run_main", "run_target", "serve",
           "signal_child", "signal_pid", "start_exec", "stop", "sweep", "unheld", "warm_name",
           "watched"]
