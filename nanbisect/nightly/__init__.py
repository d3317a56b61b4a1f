"""`nanbisect triage DIR...`: every bundle under the given directories, replayed in parallel,
grouped by culprit signature, for nightly jobs that must finish whatever the bundles do.

Guarantees:
- Every replay runs in a fresh process of its own (`nanbisect run` in a new session, started by
  a joblib worker: loky processes here by default, or the workers of an existing Dask or Ray
  cluster with ``backend="dask"|"ray"``). A replay that hangs past ``timeout`` seconds has its
  whole process group killed; one that crashes (a segfault, ``os.abort``, a SIGKILL as by the
  out-of-memory killer) or exits without a report becomes that bundle's row in ``errors``
  ({bundle, error, kind}), with the reason ("replay killed by signal SIGSEGV", "replay exceeded
  --timeout 5s"), never the whole run's failure. A bundle that cannot be read (corrupted files, a
  manifest nested 100k levels deep, ``"files": []``, garbage) is an error row too: every
  exception of one bundle is caught and named.
- Nothing is left running: each replay's process holds a pipe to the process that started it and
  forks a small guardian that kills the replay's whole process group and removes its scratch
  directory as soon as that pipe closes (the starter finished with it or died, by any signal,
  ``kill -9`` included); on Linux the replay also gets ``PR_SET_PDEATHSIG``. A loky worker
  watches its parent and exits (killing its replays) when the triage process is gone.
  SIGTERM/SIGINT stop the workers and their replays. A scratch directory that a ``kill -9`` in
  the instant before a guardian existed leaves behind is removed by the next run.
- The summary (``triage.json``, ``triage.md`` and ``index.html``, `nanbisect.nightly.index`, in
  ``out``) is written when the run starts (every
  bundle pending), after each finished bundle, and at the end, each time by writing a temporary
  file and renaming it over the old one, so a reader never sees half a file. On SIGTERM or SIGINT
  triage writes what it knows (unfinished bundles become error rows, ``interrupted`` names the
  signal) and returns; ``kill -9`` leaves the last summary written.
- Each bundle's report directory is kept at ``out/reports/NAME`` (never inside the bundle;
  `nanbisect.nightly.reports`), replaced whole, removed when the bundle has no report tonight.
  One that cannot be written there (a full disk, a read-only or foreign directory in its way)
  leaves the bundle's row in place with ``report_error`` (one line: the OSError's strerror and
  the path), listed in triage.md; such a night exits 2 unless a signature is new (3), and the
  command says so in one line on stderr (`summary.reports_not_written`).
- ``--known FILE`` that does not exist yet (a nightly job's first night) is an empty list, with a
  note on stderr and in triage.json's ``notes``; one that is not a regular file (a directory,
  /dev/zero, a FIFO) is refused, one line (`known`).
- Analyses are cached as JSON in ``out/cache``, or in ``cache`` (``--cache``: a directory that
  dated ``out`` folders share; made at the start, like ``out``; nothing pickled), with a copy
  of each report directory (a hit whose copy is gone is replayed), keyed by the manifest's
  sha256
  (which holds every file's; the files are checked against it before each lookup), the entry
  string, the sha256 of the entry file and of every user source file the manifest lists *as they
  are on disk now* (editing the code invalidates the entry: a fixed bug does not keep its old
  culprit), the replay options, and the nanbisect and torch versions; a moved or copied bundle
  is still a hit, and copies found in one run are replayed once. Only replays that produced a
  report are cached; errors are retried next time.
- Directories that are not bundles are not searched further and are listed in ``skipped``
  (the topmost such directory, with the reason); hidden directories are never searched, and
  the staging directories killed captures leave (``.NAME.tmp-XXXXXXXX``) are listed in
  ``leftovers`` (`nanbisect.bundle.leftovers`).

Not guaranteed: a replay's descendants that start a session of their own are outside its process
group (the multi-rank launcher's ranks are, and its own janitor ends them when the replay dies;
other such processes live until their own time-outs). On a Dask or Ray cluster: an interrupted
or killed triage cannot stop replays already running on the workers (they end at ``timeout``);
the workers must see the bundle paths (a shared file system) and have nanbisect installed;
joblib replays in the calling process when it counts a single slot, so a 1-thread Dask cluster
is used as two slots and a Ray cluster needs 2 CPUs or more (fewer is refused); Ray's joblib
backend returns results per wave of as many bundles as the cluster has CPUs (the summary is
written per wave). Reading the manifests and hashing the files happens in the triage process,
bounded by `nanbisect.bundle.format.read_bundle`'s limits, not by ``timeout``. Connecting to a
cluster is bounded by ``NANBISECT_CONNECT_TIMEOUT`` (default 15 s; twice that for Ray). POSIX
only.

The Python API's function is ``nanbisect.triage`` (`nanbisect.api.triage`: the command's checks,
defaults and `TriageReport`); this package's own `triage` (`night.triage`) is the night itself,
which that function and the command call. The package is named ``nightly`` so that
``nanbisect.triage`` means one thing, the function, whatever was imported first; it is imported
by the API and never imports it.

The package's internal interface (what its modules share, not for other stages):
- `find.check_roots` and `find.check_outputs` (the roots, ``--out`` and ``--cache`` refused
  before anything runs) and `find.MAX_MANIFEST` (the bound on a manifest read while
  discovering: `read_bundle`'s own), used by `night`, `cache`, `summary` (and by the API's
  checks, `nanbisect.api.check_triage`);
- `cache.Cache` (the cache directory: lookups and stores) and `cache.MAX_REPORT` (the bound on a
  cached or replayed report.json), used by `night` and `one_bundle`;
- `summary.NightState` (the night so far: rows, errors, what triage.json/md and index.html are
  written from), built and updated by `night`;
- `backends.connect_backend` (the cluster connected: joblib's configuration, slots, wave size)
  and `backends.jobs_for` (the slots for a night of bundles), used by `night`;
- `one_bundle.analyse_one` (one bundle's replay in a process of its own; never raises), which `night`
  hands to joblib;
- `known.check_known`, `known.load_known` and `known.given_known` (the ``--known`` file, or the
  signatures given as values), used by the API (`nanbisect.api.check_triage`, `triage`).

Exit protocol (for CI):
  0  no failures: every bundle replayed clean
  1  failures, all with known signatures (``--known``)
  3  at least one new signature
  2  no new signature, but some bundle could not be triaged (listed in ``errors``) or its
     report could not be written (``report_error`` on its row); an interrupted run is never
     0 or 1
"""
from __future__ import annotations

import importlib

# name -> the module of this package that defines it; imported on first use (PEP 562), so that
# `nanbisect.nightly.backends` alone (the CLI's usage checks) stays a light import
_WHERE = {"BACKENDS": "backends", "CONNECT_TIMEOUT": "backends", "CACHE_SCHEMA": "cache",
          "cache_key": "cache", "content_hash": "cache", "discover": "find",
          "find_bundles": "find", "DEFAULT_TIMEOUT": "night", "triage": "night",
          "normalise_module": "signatures", "signature": "signatures", "EXIT_CLEAN": "summary",
          "EXIT_ERRORS": "summary", "EXIT_KNOWN": "summary", "EXIT_NEW": "summary",
          "SCHEMA": "summary", "TriageResult": "summary", "load_known": "known",
          "reports_not_written": "summary", "to_markdown": "summary"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'nanbisect.nightly' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"nanbisect.nightly.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
