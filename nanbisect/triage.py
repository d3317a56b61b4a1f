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
- The summary (``triage.json``, ``triage.md`` in ``out``) is written when the run starts (every
  bundle pending), after each finished bundle, and at the end, each time by writing a temporary
  file and renaming it over the old one, so a reader never sees half a file. On SIGTERM or SIGINT
  triage writes what it knows (unfinished bundles become error rows, ``interrupted`` names the
  signal) and returns; ``kill -9`` leaves the last summary written.
- Analyses are cached as JSON in ``out/cache`` (nothing pickled), keyed by the manifest's sha256
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

Exit protocol (for CI):
  0  no failures: every bundle replayed clean
  1  failures, all with known signatures (``--known``)
  3  at least one new signature
  2  no new signature, but some bundle could not be triaged (listed in ``errors``); an
     interrupted run is never 0 or 1
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from nanbisect import __version__
from nanbisect.errors import BadInput, signal_name
from nanbisect.records import module_label

SCHEMA = "nanbisect.triage/1"
CACHE_SCHEMA = "nanbisect.triage-cache/1"
EXIT_CLEAN, EXIT_KNOWN, EXIT_ERRORS, EXIT_NEW = 0, 1, 2, 3
MANIFEST = "manifest.json"          # = nanbisect.bundle.format.MANIFEST (not imported: torch)
DEFAULT_TIMEOUT = 1800.0            # seconds per bundle
CONNECT_TIMEOUT = 15.0              # seconds to reach a Dask scheduler / Ray cluster (default of
#                                     NANBISECT_CONNECT_TIMEOUT)
BACKENDS = ("loky", "dask", "ray")
_MAX_MANIFEST = 64 << 20            # read_bundle's own bound; checked before reading a head
_MAX_SOURCE = 16 << 20              # a user source file bigger than this is keyed by size+mtime
_MAX_REPORT = 64 << 20
_STDERR_TAIL = 2000
_CLUSTER_HINT = "pip install 'nanbisect[cluster]'"


# --------------------------------------------------------------------------------------------
# finding bundles


def _manifest_kind(path: Path) -> str | None:
    """None: a bundle candidate (also when its manifest is garbage: that is reported);
    otherwise why this manifest.json is not nanbisect's."""
    try:
        st = os.stat(path)
    except OSError:
        return None                      # dangling link, unreadable: an error row says why
    if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_MANIFEST:
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return None
    m = re.search(r'"schema"\s*:\s*"([^"]{0,200})"', head)
    if m and not m.group(1).startswith("nanbisect.bundle/"):
        return f"manifest.json is not a nanbisect manifest (schema {m.group(1)[:60]!r})"
    return None


def _is_report(path: Path) -> bool:
    return path.name == "nanbisect-report" or (path / ".nanbisect-report").exists()


def discover(roots: list[Path], exclude: tuple[Path, ...] = ()
             ) -> tuple[list[Path], list[dict]]:
    """(bundles, skipped) under ``roots``.

    A bundle is a directory holding a nanbisect ``manifest.json`` (one whose head names another
    schema is skipped); a multi-rank bundle's rank parts belong to it and report directories are
    ours, so neither is searched. Hidden directories (leftovers of killed captures among them)
    and ``exclude`` (triage's own output) are not searched. ``skipped`` lists the topmost
    directories holding no bundle, and links, each as {path, reason}. Iterative: a directory
    tree of any depth is fine.
    """
    bundles: list[Path] = []
    notes: dict[Path, str] = {}          # visited non-bundle dirs / links -> reason
    parent_of: dict[Path, Path | None] = {}
    def ident(p: Path):
        try:
            st = os.stat(p)
            return st.st_dev, st.st_ino         # O(1) per directory, unlike Path.resolve
        except OSError:
            return str(p)

    excluded = {ident(e) for e in exclude if os.path.isdir(e)}
    seen: set = set()
    for root in roots:
        root = Path(root)
        stack: list[tuple[Path, Path | None]] = [(root, None)]
        while stack:
            d, parent = stack.pop()
            real = ident(d)
            if real in seen or real in excluded:
                continue
            seen.add(real)
            parent_of[d] = parent
            try:
                has_manifest = (d / MANIFEST).exists() or (d / MANIFEST).is_symlink()
            except OSError as e:       # a directory we may not search (another user's job)
                notes[d] = f"cannot look inside it ({e.strerror or e})"
                continue
            if has_manifest:
                why = _manifest_kind(d / MANIFEST)
                if why is None:
                    bundles.append(d)
                else:
                    notes[d] = why
                continue
            notes[d] = "no manifest.json in it or below it"
            try:
                with os.scandir(d) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError as e:
                notes[d] = f"cannot list it ({e.strerror or e})"
                continue
            for e in reversed(entries):
                if e.name.startswith(".") or e.name == "nanbisect-report":
                    continue
                p = Path(e.path)
                try:
                    if e.is_symlink():
                        if p.is_dir():
                            parent_of[p] = d
                            notes[p] = "a symbolic link to a directory, not followed"
                        continue
                    if not e.is_dir(follow_symlinks=False) or _is_report(p):
                        continue
                except OSError:
                    continue
                stack.append((p, d))
    containers: set[Path] = set()
    for b in bundles:
        p = parent_of.get(b)
        while p is not None and p not in containers:
            containers.add(p)
            p = parent_of.get(p)
    skipped = [{"path": str(d), "reason": why} for d, why in sorted(notes.items())
               if d not in containers and (parent_of.get(d) is None
                                           or parent_of[d] in containers)]
    return bundles, skipped


def find_bundles(roots: list[Path]) -> list[Path]:
    """The bundles under ``roots`` (see `discover`); a missing root is `BadInput`."""
    _check_roots(roots)
    return discover(roots)[0]


def _check_roots(roots: list[Path]) -> None:
    if not roots:
        raise BadInput("triage: no directory given; pass the directories that hold bundles")
    for root in roots:
        if not Path(root).exists():
            raise BadInput(f"triage: '{root}' does not exist; pass directories holding bundles")
        if not Path(root).is_dir():
            raise BadInput(f"triage: '{root}' is a file, not a directory; pass directories "
                           "holding bundles")


# --------------------------------------------------------------------------------------------
# signatures


def normalise_module(name: str) -> str:
    """``layers.17.mlp`` -> ``layers.N.mlp``: the same code at another depth groups together."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "N", name)


def signature(report: dict) -> str | None:
    c = report.get("culprit")
    if report.get("verdict") != "culprit" or not c:
        if report.get("verdict") == "input-nonfinite":
            return "input-nonfinite · data"
        if report.get("verdict") == "not-reproduced":
            # code-changed, replay-mismatch, unknown and transient are different nights
            return f"not-reproduced · {report.get('classification') or 'unknown'}"
        return None
    return " · ".join([c.get("op") or "-", normalise_module(module_label(c.get("module"))),
                       c.get("phase") or "-", ",".join(c.get("input_dtypes") or []) or "-",
                       report.get("classification") or "-"])


# --------------------------------------------------------------------------------------------
# the cache key: what the bundle holds, and the code and versions that would replay it now


def _file_digest(path: Path) -> str | None:
    """sha256 of a regular file on disk now (None: missing); a huge or special file by kind and
    size, so a hostile manifest listing /dev/zero cannot stall the key."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return f"not-a-file:{stat.S_IFMT(st.st_mode)}"
    if st.st_size > _MAX_SOURCE:
        return f"large:{st.st_size}:{st.st_mtime_ns}"
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            h.update(f.read(_MAX_SOURCE + 1))
    except OSError:
        return None
    return h.hexdigest()


def _entry_file(bundle: Path, manifest: dict) -> Path | None:
    """The file the replay will import for a ``path.py:func`` entry (as `resolve_entry` finds
    it: beside the bundle, here, or where it was)."""
    entry = manifest.get("entry")
    if not isinstance(entry, str):
        return None
    target = entry.rpartition(":")[0]
    if not target.endswith(".py"):
        return None
    rel = manifest.get("entry_file_from_bundle")
    cands = [bundle / rel] if isinstance(rel, str) and rel else []
    cands.append(Path(target))
    if isinstance(manifest.get("entry_file"), str):
        cands.append(Path(manifest["entry_file"]))
    for c in cands:
        try:
            if c.is_file():
                return c.resolve()
        except (OSError, ValueError):
            continue
    return None


def _sources(manifest: dict) -> dict:
    code = manifest.get("code")
    src = code.get("sources") if isinstance(code, dict) else None
    return src if isinstance(src, dict) else {}


def cache_key(bundle, options: dict) -> tuple[str, dict]:
    """(key, what it was made of) for a bundle that `read_bundle` accepted."""
    import torch

    from nanbisect.bundle.code import relocation

    m = bundle.manifest
    entry_file = _entry_file(bundle.path, m)
    captured = (m.get("code") or {}).get("entry_file") if isinstance(m.get("code"), dict) \
        else None
    captured = captured or m.get("entry_file")
    moved = relocation(captured, str(entry_file)) if isinstance(captured, str) and entry_file \
        else None
    recorded = dict(_sources(m))
    if bundle.multi_rank:
        for info in (m.get("ranks") or {}).values():
            try:
                raw = (bundle.path / info["dir"] / MANIFEST).read_bytes()
                recorded.update(_sources(json.loads(raw[:_MAX_MANIFEST])))
            except Exception:  # noqa: BLE001 - read_bundle verified them; the key stays usable
                continue
    sources = {}
    for p in sorted(k for k in recorded if isinstance(k, str))[:100_000]:
        path = Path(p)
        if moved is not None:
            try:
                cand = moved[1] / path.relative_to(moved[0])
                if cand.is_file():
                    path = cand
            except ValueError:
                pass
        sources[p] = _file_digest(path)
    material = {"schema": CACHE_SCHEMA,
                "manifest": hashlib.sha256((bundle.path / MANIFEST).read_bytes()).hexdigest(),
                "entry": m.get("entry"),
                "entry_file": _file_digest(entry_file) if entry_file else None,
                "sources": sources, "options": options,
                "nanbisect": __version__, "torch": torch.__version__}
    key = hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()
    return key, material


def content_hash(bundle: Path) -> str:
    """sha256 of the bundle's manifest (which holds every file's sha256)."""
    return hashlib.sha256((Path(bundle) / MANIFEST).read_bytes()).hexdigest()


class _Cache:
    """``DIR/<key>.json`` = {schema, key, report}; written atomically, unreadable = a miss."""

    def __init__(self, root: Path | None):
        self.root = root

    def get(self, key: str) -> dict | None:
        if self.root is None:
            return None
        data = _read_json(self.root / f"{key}.json")
        if isinstance(data, dict) and data.get("schema") == CACHE_SCHEMA and \
                data.get("key") == key and isinstance(data.get("report"), dict):
            return data["report"]
        return None

    def put(self, key: str, report: dict) -> None:
        if self.root is None:
            return
        with contextlib.suppress(OSError):
            self.root.mkdir(parents=True, exist_ok=True)
            _atomic_write(self.root / f"{key}.json",
                          json.dumps({"schema": CACHE_SCHEMA, "key": key, "report": report}))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


# --------------------------------------------------------------------------------------------
# one bundle, in a worker: the replay in a process of its own


def _guard_replay() -> None:
    """Called first in the replay process (``python -c _CHILD run BUNDLE ...``, in a session of
    its own), which then runs the CLI. It dies with the thread that started it (Linux
    ``PR_SET_PDEATHSIG``) and forks a guardian holding the read end of a pipe whose write end
    only the starter has: when the starter is done with it or dies (SIGKILL too), the read
    returns EOF and the guardian kills the replay's whole process group and removes the
    replay's scratch directory (which a starter killed by SIGKILL cannot)."""
    fd = int(os.environ.pop("NANBISECT_TRIAGE_FD"))
    starter = int(os.environ.pop("NANBISECT_TRIAGE_PARENT"))
    scratch = os.environ.pop("NANBISECT_TRIAGE_TMP", "")
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))     # PR_SET_PDEATHSIG
    if os.getppid() != starter:         # it died before the line above
        os._exit(125)
    group = os.getpgrp()
    if os.fork() == 0:
        said = b""                      # the starter writes "done" before it closes its end
        try:
            os.setpgid(0, 0)            # out of the group it is about to kill
            os.closerange(0, fd)
            while chunk := os.read(fd, 4096):
                said += chunk[:16]
        except BaseException:  # noqa: BLE001 - whatever happens, the group goes
            pass
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
        if os.path.basename(scratch).startswith("nanbisect-triage-"):
            shutil.rmtree(scratch, ignore_errors=True)   # what a killed starter could not
            up = os.path.dirname(scratch)
            if not said.startswith(b"done") and os.path.basename(up).startswith(
                    "nanbisect-triage-"):
                with contextlib.suppress(OSError):
                    os.rmdir(up)        # the starter died: the run's directory, once empty
        os._exit(0)
    os.close(fd)
    sys.argv[0] = "nanbisect"


_CHILD = ("from nanbisect.triage import _guard_replay; _guard_replay(); "
          "from nanbisect.cli import main; main()")
_active: set[int] = set()              # process groups of replays this process is running
_active_lock = threading.Lock()
_watchdog_for: list[int] = []


def _watch_parent(parent: int) -> None:
    """In a loky worker: when the triage process is gone (kill -9 included), kill our replays
    and exit, instead of waiting for them as loky would."""
    if _watchdog_for or os.getppid() != parent:
        return                          # already watching, or not a child of triage (a cluster)
    _watchdog_for.append(parent)

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        with _active_lock:
            for pg in list(_active):
                with contextlib.suppress(OSError):
                    os.killpg(pg, signal.SIGKILL)
        os._exit(70)

    threading.Thread(target=loop, name="nanbisect-triage-watchdog", daemon=True).start()


_SIGNAL_HINT = {"SIGKILL": " (as the out-of-memory killer does)", "SIGSEGV": " (a crash in native "
                "code)", "SIGABRT": " (os.abort or a failed native assertion)"}


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 8192))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _reason(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("nanbisect: error: "):
            return ln[len("nanbisect: error: "):]
    return lines[-1][:300] if lines else "no message"


def _read_json(p: Path):
    """The JSON in ``p`` (at most _MAX_REPORT bytes), or None when it is missing or unreadable."""
    try:
        if p.stat().st_size > _MAX_REPORT:
            return None
        return json.loads(p.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None


def _read_report(report_dir: Path) -> dict | None:
    data = _read_json(report_dir / "report.json")
    return data if isinstance(data, dict) and isinstance(data.get("verdict"), str) else None


def _analyse_one(bundle: str, options: dict, timeout: float, parent: int,
                 cwd: str | None = None, scratch: str | None = None) -> dict:
    """Replay one bundle with `nanbisect run` in a fresh process; never raises. Its scratch
    directory goes under ``scratch`` (the triage run's, when this machine has it).

    Returns {bundle, report, seconds} or {bundle, error, kind, seconds[, stderr]}."""
    t0 = time.monotonic()

    def done(**kw) -> dict:
        return {"bundle": bundle, "seconds": round(time.monotonic() - t0, 2),
                "worker": f"{socket.gethostname()}:{os.getpid()}", **kw}

    try:
        _watch_parent(parent)
        tmp = Path(tempfile.mkdtemp(prefix="nanbisect-triage-", dir=scratch if scratch and
                                    os.path.isdir(scratch) else None))
    except Exception as e:  # noqa: BLE001
        return done(error=f"could not start the replay ({type(e).__name__}: {e})", kind="crash")
    proc = None
    r = w = -1
    try:
        out = tmp / "report"            # `run --out` refuses existing directories: a fresh path
        cmd = [sys.executable, "-c", _CHILD, "run", bundle, "--out", str(out),
               "--reference", str(options.get("reference") or "none")]
        if options.get("target"):
            cmd += ["--target", str(options["target"])]
        r, w = os.pipe()
        env = {**os.environ, "NANBISECT_TRIAGE_FD": str(r),
               "NANBISECT_TRIAGE_PARENT": str(os.getpid()), "NANBISECT_TRIAGE_TMP": str(tmp)}
        with open(tmp / "stderr", "wb") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err, pass_fds=(r,), start_new_session=True, env=env,
                                    cwd=cwd if cwd and os.path.isdir(cwd) else None)
        os.close(r)
        r = -1
        with _active_lock:
            _active.add(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return done(error=f"replay exceeded --timeout {timeout:g}s and was killed",
                        kind="timeout")
        stderr = _tail(tmp / "stderr")
        report = _read_report(out) if rc in (0, 1, 3) else None
        if report is not None:
            return done(report=report)
        extra = {"stderr": stderr[-_STDERR_TAIL:]} if stderr.strip() else {}
        if rc < 0:
            name = signal_name(-rc)
            return done(error=f"replay killed by signal {name}{_SIGNAL_HINT.get(name, '')}",
                        kind="signal", **extra)
        if rc == 2:
            return done(error=_reason(stderr), kind="bad-input", **extra)
        return done(error=f"replay exited with code {rc} without a report: {_reason(stderr)}",
                    kind="crash", **extra)
    except Exception as e:  # noqa: BLE001 - one bundle must never stop the night
        return done(error=f"replay could not run ({type(e).__name__}: {str(e)[:300]})",
                    kind="crash")
    finally:
        if proc is not None:
            if proc.poll() is None:     # interrupted while waiting: the replay goes too
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    proc.wait(5)
            with _active_lock:
                _active.discard(proc.pid)
        if w >= 0:
            with contextlib.suppress(OSError):
                os.write(w, b"done")    # a finish, not a death: the run's directory stays
        for fd in (r, w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)       # closing w lets the guardian clear the process group
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# backends


def _host_port(address: str) -> tuple[str, int] | None:
    m = re.fullmatch(r"(?:(?:tcp|tls|ray)://)?\[?([^\]/]+?)\]?:(\d+)/?", address.strip())
    return (m.group(1), int(m.group(2))) if m else None


def _connect_timeout() -> float:
    """``NANBISECT_CONNECT_TIMEOUT`` (seconds) as it is now, else `CONNECT_TIMEOUT`."""
    raw = os.environ.get("NANBISECT_CONNECT_TIMEOUT")
    try:
        value = float(raw) if raw else CONNECT_TIMEOUT
    except ValueError:
        value = -1.0
    if not value > 0:
        raise BadInput(f"NANBISECT_CONNECT_TIMEOUT={raw!r} is not a positive number of "
                       "seconds; set it to e.g. 15 or unset it")
    return value


def _reachable(address: str, what: str, flag: str, greets: bool = False) -> None:
    """A TCP connection within `_connect_timeout`; with ``greets`` (a Dask scheduler over plain
    TCP sends its handshake first), also its first byte: a port that accepts and stays silent
    would otherwise hold the client library's connect for minutes."""
    hp = _host_port(address)
    if hp is None:      # a form we cannot probe (ray "auto", ucx://): the library's time-out
        return
    wait = _connect_timeout()
    try:
        sock = socket.create_connection(hp, timeout=wait)
    except OSError as e:
        raise BadInput(f"triage: cannot reach the {what} at {flag} {address} "
                       f"({e.strerror or type(e).__name__}); start it or pass its address"
                       ) from None
    with sock:
        if not greets or address.strip().startswith("tls://"):
            return
        try:
            first = sock.recv(1)
        except OSError:
            first = b""
        if not first:
            raise BadInput(f"triage: {flag} {address} accepts connections but sent no Dask "
                           f"handshake within {wait:g}s; pass the scheduler's "
                           "address (its log prints it; the default port is 8786)")


@contextlib.contextmanager
def _backend(backend: str, scheduler: str | None, address: str | None, jobs: int | None):
    """Connect to the cluster; yields (joblib parallel_config kwargs, n_jobs, wave size or None
    when results come back one by one)."""
    if backend not in BACKENDS:
        raise BadInput(f"triage: unknown --backend {backend!r}; pass one of {', '.join(BACKENDS)}")
    if scheduler and backend != "dask":
        raise BadInput("triage: --scheduler is the Dask scheduler's address; pass it with "
                       "--backend dask")
    if address and backend != "ray":
        raise BadInput("triage: --address is the Ray cluster's address; pass it with "
                       "--backend ray")
    if backend == "loky":
        yield {"backend": "loky"}, jobs, None
        return
    wait = _connect_timeout()
    if backend == "dask":
        if not scheduler:
            raise BadInput("triage: --backend dask needs --scheduler ADDR (e.g. "
                           "tcp://10.0.0.5:8786), the scheduler of a running Dask cluster")
        try:
            import distributed
        except ImportError as e:
            raise BadInput(f"triage: --backend dask needs dask.distributed ({e}); "
                           f"{_CLUSTER_HINT}") from None
        _reachable(scheduler, "Dask scheduler", "--scheduler", greets=True)
        try:
            client = distributed.Client(scheduler, timeout=wait, set_as_default=False)
        except Exception as e:  # noqa: BLE001 - OSError, TimeoutError, a version mismatch...
            raise BadInput(f"triage: cannot connect to the Dask scheduler at --scheduler "
                           f"{scheduler} ({type(e).__name__}: {str(e)[:160]}); check the "
                           "address and that its dask version matches") from None
        try:
            try:
                client.wait_for_workers(1, timeout=wait)
            except Exception:  # noqa: BLE001
                raise BadInput(f"triage: the Dask scheduler at {scheduler} has no workers "
                               f"after {wait:g}s; start some (dask worker "
                               f"{scheduler})") from None
            yield {"backend": _dask_backend(), "client": client}, jobs or -1, None
        finally:
            with contextlib.suppress(Exception):
                client.close(timeout=5)
        return
    try:
        import ray
        from ray.util.joblib import register_ray
    except ImportError as e:
        raise BadInput(f"triage: --backend ray needs ray ({e}); {_CLUSTER_HINT}") from None
    if address:
        _reachable(address, "Ray cluster", "--address")
    register_ray()
    # ray.init retries for minutes on an address that accepts and never answers: it runs in a
    # daemon thread and is given up on after a bounded time
    outcome: list = []

    def init() -> None:
        try:
            ray.init(address=address or "auto", log_to_driver=False, logging_level="ERROR",
                     ignore_reinit_error=True)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below, in the caller's thread
            outcome.append(e)

    t = threading.Thread(target=init, name="nanbisect-ray-init", daemon=True)
    with _stderr_held() as held:         # Ray's C++ client logs its retries to fd 2
        t.start()
        t.join(2 * wait)
        ok = bool(outcome) and outcome[0] is None
        held.release = ok                # kept when it connected; a failure is one line
    if not ok:
        why = (f"{type(outcome[0]).__name__}: {str(outcome[0])[:160]}" if outcome else
               f"no answer within {2 * wait:g}s")
        raise BadInput(f"triage: cannot connect to the Ray cluster at --address "
                       f"{address or 'auto'} ({why}); check the address (ray status prints "
                       "it)")
    try:
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus < 2:                    # joblib would replay in this process, not on the cluster
            raise BadInput(f"triage: the Ray cluster at {address or 'auto'} has {cpus} CPU(s); "
                           "joblib's Ray backend needs at least 2 to replay on the cluster "
                           "(with 1 it runs everything here); add CPUs or use --backend dask")
        n = min(cpus, max(2, jobs or cpus))
        yield {"backend": "ray"}, n, n
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()


def _dask_backend() -> str:
    """joblib's Dask backend, except that a cluster with a single worker thread still counts two
    slots: joblib replays in the calling process when it counts one, and a replay meant for the
    cluster must run there."""
    from joblib import register_parallel_backend

    try:
        from joblib._dask import DaskDistributedBackend
    except ImportError:                 # a joblib that moved it: its plain backend
        return "dask"

    class _ClusterOnly(DaskDistributedBackend):
        def effective_n_jobs(self, n_jobs):
            return max(2, super().effective_n_jobs(n_jobs))

    register_parallel_backend("nanbisect-dask", _ClusterOnly)
    return "nanbisect-dask"


@contextlib.contextmanager
def _stderr_held():
    """File descriptor 2 goes to a temporary file for the block; what was written is copied to
    the real stderr afterwards when the block sets ``.release`` (and dropped otherwise)."""
    class Held:
        release = True

    held = Held()
    try:
        sys.stderr.flush()
        tmp = tempfile.TemporaryFile()
    except (OSError, ValueError):
        tmp = None
    try:
        saved = os.dup(2) if tmp is not None else -1
    except OSError:                      # no fd 2 to hold: leave it as it is
        saved = -1
    if saved < 0:
        if tmp is not None:
            tmp.close()
        yield held
        return
    os.dup2(tmp.fileno(), 2)
    try:
        yield held
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if held.release:
            with contextlib.suppress(OSError):
                tmp.seek(0)
                os.write(2, tmp.read()[-65536:])
        tmp.close()


def _jobs(bundles: list[Path], jobs: int | None) -> int:
    if jobs:
        return max(1, jobs)
    cores = os.cpu_count() or 1
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return cores
    biggest = 0
    for b in bundles:
        with contextlib.suppress(OSError):
            # a bundle's tensors are at its top or in its rank parts: no recursive walk
            files = [*b.glob("*.safetensors"), *b.glob("rank*/*.safetensors")]
            biggest = max(biggest, sum(f.stat().st_size for f in files))
    return max(1, min(cores, len(bundles), int(avail // max(3 * biggest, 1 << 28))))


class _Interrupted(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _interruptible():
    """SIGTERM and SIGINT raise `_Interrupted` in the main thread (once)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [signal.SIGINT, signal.SIGTERM]
    old = {s: signal.getsignal(s) for s in sigs}

    def handler(signum, frame):
        for s in sigs:                  # the second signal must not cut the summary's write
            signal.signal(s, signal.SIG_IGN)
        raise _Interrupted(signum)

    for s in sigs:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------------------------
# the run


@dataclass(frozen=True)
class TriageResult:
    data: dict
    exit_code: int


@dataclass
class _State:
    roots: list[Path]
    known: set
    out: Path | None
    options: dict
    backend: str
    timeout: float
    results: dict = field(default_factory=dict)     # bundle -> row
    errors: dict = field(default_factory=dict)      # bundle -> {bundle, error, ...}
    pending: set = field(default_factory=set)
    skipped: list = field(default_factory=list)
    leftovers: list = field(default_factory=list)
    interrupted: str | None = None
    finished: bool = False
    started: float = field(default_factory=time.monotonic)
    written: float = 0.0

    def data(self) -> dict:
        results = [self.results[k] for k in sorted(self.results)]
        errors = [self.errors[k] for k in sorted(self.errors)]
        if self.finished:
            why = (f"triage interrupted by {self.interrupted} before this bundle finished"
                   if self.interrupted else "triage ended before this bundle finished")
            errors += [{"bundle": b, "error": why, "kind": "interrupted"}
                       for b in sorted(self.pending) if b not in self.errors]
            errors.sort(key=lambda e: e["bundle"])
        groups: dict[str, dict] = {}
        for r in results:
            sig = r["signature"]
            if sig is None:
                continue
            created = r.get("created")
            g = groups.setdefault(sig, {"signature": sig, "count": 0, "first_seen": created,
                                        "example": r["bundle"], "known": sig in self.known,
                                        "classification": r.get("classification"),
                                        "bundles": []})
            g["count"] += 1
            g["bundles"].append(r["bundle"])
            if created and (g["first_seen"] is None or created < g["first_seen"]):
                g["first_seen"], g["example"] = created, r["bundle"]
        sigs = sorted(groups.values(), key=lambda g: (-g["count"], g["signature"]))
        if any(not g["known"] for g in sigs):
            code = EXIT_NEW
        elif errors or self.interrupted or self.pending:
            code = EXIT_ERRORS
        elif sigs:
            code = EXIT_KNOWN
        else:
            code = EXIT_CLEAN
        return {"schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                "nanbisect": __version__, "roots": [str(r) for r in self.roots],
                "host": f"{socket.gethostname()}:{os.getpid()}",
                "backend": self.backend, "timeout_s": self.timeout,
                "options": self.options, "finished": self.finished,
                "interrupted": self.interrupted,
                "seconds": round(time.monotonic() - self.started, 1),
                "pending": [] if self.finished else sorted(self.pending),
                "bundles": [{k: v for k, v in r.items() if k != "created"} for r in results],
                "signatures": sigs, "errors": errors, "skipped": self.skipped,
                "leftovers": self.leftovers, "exit_code": code}

    def write(self, final: bool = False) -> dict | None:
        """Replace the summary files; during the run a failed write is retried at the next
        bundle, the final one is `BadInput` when it fails. A night of more than 500 bundles is
        rewritten at most once a second (each write is of the whole summary)."""
        now = time.monotonic()
        if not final and len(self.results) + len(self.errors) > 500 and now - self.written < 1:
            return None
        self.written = now
        data = self.data()
        if self.out is not None:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                _atomic_write(self.out / "triage.json", json.dumps(data, indent=1))
                _atomic_write(self.out / "triage.md", to_markdown(data))
            except OSError as e:
                if final:
                    raise BadInput(f"triage: cannot write triage.json into --out '{self.out}' "
                                   f"({e.strerror or e}); pass a writable directory") from None
        return data

    def add(self, res: dict, cached: bool) -> None:
        b = res["bundle"]
        self.pending.discard(b)
        if "error" in res:
            self.errors[b] = res
            return
        rep = res["report"]
        self.results[b] = {"bundle": b, "verdict": rep.get("verdict"),
                           "classification": rep.get("classification"),
                           "signature": signature(rep), "cached": cached,
                           "seconds": res.get("seconds", 0.0), "worker": res.get("worker"),
                           **({"same_as": res["same_as"]} if "same_as" in res else {}),
                           "created": _created(Path(b))}


def triage(roots: list[Path], *, jobs: int | None = None, known: set[str] = frozenset(),
           cache: Path | None = None, options: dict | None = None, out: Path | None = None,
           timeout: float = DEFAULT_TIMEOUT, backend: str = "loky",
           scheduler: str | None = None, address: str | None = None) -> TriageResult:
    """Triage every bundle under ``roots``; with ``out``, keep ``out/triage.json`` and
    ``out/triage.md`` current and cache in ``out/cache`` (or ``cache``).

    >>> import shutil, tempfile
    >>> night = Path(tempfile.mkdtemp())
    >>> _ = shutil.copytree("fixtures/bundles/nan_batch", night / "job1" / "step5",
    ...                     ignore=shutil.ignore_patterns("nanbisect-report"))
    >>> (night / "notes").mkdir()
    >>> res = triage([night], jobs=1)
    >>> [(g["signature"], g["count"]) for g in res.data["signatures"]], res.exit_code
    ([('input-nonfinite · data', 1)], 3)
    >>> [s["path"].endswith("notes") for s in res.data["skipped"]]
    [True]
    """
    roots = [Path(r) for r in roots]
    _check_roots(roots)
    try:
        timeout = float(timeout)
    except (TypeError, ValueError):
        raise BadInput(f"triage: --timeout {timeout!r} is not a number of seconds") from None
    if not timeout > 0:
        raise BadInput(f"triage: --timeout {timeout:g} must be more than 0 seconds")
    if out is not None:
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise BadInput(f"triage: --out '{out}' is a file; pass a directory for triage.json, "
                           "triage.md and the cache")
        cache = cache if cache is not None else out / "cache"
    options = {"reference": "none", **(options or {})}
    from nanbisect.bundle.leftovers import find_leftovers

    state = _State(roots, set(known), out, options, backend, timeout)
    store = _Cache(cache)
    with _interruptible():
        try:
            bundles, state.skipped = discover(roots, exclude=tuple(p for p in (out, cache) if p))
            state.pending = {str(b) for b in bundles}
            try:
                state.leftovers = [x.to_json() for x in find_leftovers(roots)]
            except Exception as e:  # noqa: BLE001 - a listing problem must not stop the night
                state.leftovers = [{"path": "", "bytes": 0, "age_s": 0.0, "kind": "error",
                                    "error": f"{type(e).__name__}: {str(e)[:200]}"}]
            with _backend(backend, scheduler, address, jobs) as (config, n_jobs, wave):
                if out is not None:
                    try:
                        out.mkdir(parents=True, exist_ok=True)
                    except OSError as e:
                        raise BadInput(f"triage: cannot create --out '{out}' ({e.strerror}); "
                                       "pass a writable directory") from None
                state.write()
                todo = _lookup(bundles, options, store, state)
                state.write()
                # bundles with the same key (copies: the same content, code and options) are
                # replayed once; the others take its result
                first: dict[str, str] = {}
                copies: dict[str, list[str]] = {}
                for b, key in todo:
                    copies.setdefault(first.setdefault(key, b), []).append(b)
                todo = [(b, k) for k, b in first.items()]
                if todo:
                    if backend == "loky":
                        n_jobs = _jobs([Path(b) for b, _ in todo], n_jobs)
                    _replay(todo, copies, options, timeout, config, n_jobs, wave, store, state)
        except _Interrupted as e:
            state.interrupted = signal_name(e.signum)
        except KeyboardInterrupt:
            state.interrupted = "SIGINT"
        except BadInput:
            raise                        # before anything was written: one line, exit 2
        except Exception as e:  # noqa: BLE001 - a bug of triage's own: keep what it knew
            state.interrupted = f"an internal error ({type(e).__name__}: {str(e)[:200]})"
            state.finished = True
            state.write()
            raise
        state.finished = True
        data = state.write(final=True)
    return TriageResult(data, data["exit_code"])


def _lookup(bundles: list[Path], options: dict, store: _Cache, state: _State
            ) -> list[tuple[str, str]]:
    """Verify each bundle and answer from the cache; (bundle, key) of those left to replay.
    Any failure of one bundle (BadInput, RecursionError, TypeError...) is its error row."""
    from nanbisect.bundle.format import read_bundle

    todo = []
    for b in bundles:
        name = str(b)
        t0 = time.monotonic()
        try:
            key, _ = cache_key(read_bundle(b), options)
        except BadInput as e:
            state.add({"bundle": name, "error": str(e), "kind": "bad-input",
                       "seconds": round(time.monotonic() - t0, 2)}, False)
            continue
        except Exception as e:  # noqa: BLE001 - a malformed bundle is its own row, never fatal
            state.add({"bundle": name, "error": f"bundle '{b}' is malformed and cannot be read "
                       f"({type(e).__name__}: {str(e)[:200]}); re-capture it",
                       "kind": "malformed", "seconds": round(time.monotonic() - t0, 2)}, False)
            continue
        hit = store.get(key)
        if hit is not None:
            state.add({"bundle": name, "report": hit,
                       "seconds": round(time.monotonic() - t0, 2)}, True)
        else:
            todo.append((name, key))
    return todo


def _replay(todo: list[tuple[str, str]], copies: dict[str, list[str]], options: dict,
            timeout: float, config: dict, n_jobs: int, wave: int | None, store: _Cache,
            state: _State) -> None:
    """Run the replays through joblib; each result is cached and written as it arrives (for
    the bundle and its ``copies``). A backend failure (a worker lost) retries what did not
    finish, once. The replays' scratch directories go in one of this run's, removed at the end
    (on SIGTERM/SIGINT too; after kill -9, each replay's guardian removes its own)."""
    keys = dict(todo)
    _sweep_scratch(timeout)
    scratch = tempfile.mkdtemp(prefix=f"nanbisect-triage-{os.getpid()}-")
    try:
        _replay_all(keys, copies, options, timeout, config, n_jobs, wave, store, state, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _sweep_scratch(timeout: float) -> None:
    """Remove what killed runs left in the temporary directory: a run's scratch directory
    (``nanbisect-triage-PID-*``) whose process is gone (kill -9 of triage while a replay was
    still starting, before its guardian existed), and loose replay scratch directories older
    than a day and than twice ``timeout``."""
    tmp = Path(tempfile.gettempdir())
    try:
        entries = list(os.scandir(tmp))
    except OSError:
        return
    for e in entries:
        m = re.fullmatch(r"nanbisect-triage-(?:(\d+)-)?[a-z0-9_]{8}", e.name)
        if not m or not e.is_dir(follow_symlinks=False):
            continue
        if m.group(1):
            try:
                os.kill(int(m.group(1)), 0)
                continue                # its run is alive (or the pid was reused): leave it
            except ProcessLookupError:
                pass
            except OSError:
                continue
        else:
            with contextlib.suppress(OSError):
                if time.time() - e.stat(follow_symlinks=False).st_mtime < max(86400, 2 * timeout):
                    continue
        shutil.rmtree(e.path, ignore_errors=True)


def _replay_all(keys: dict[str, str], copies: dict[str, list[str]], options: dict,
                timeout: float, config: dict, n_jobs: int, wave: int | None, store: _Cache,
                state: _State, scratch: str) -> None:
    from joblib import Parallel, delayed, parallel_config

    absolute = {b: str(Path(b).resolve()) for b in keys}
    back = {v: k for k, v in absolute.items()}
    cwd = os.getcwd()
    parent = os.getpid()
    for attempt in (1, 2):
        left = [b for b in keys if b in state.pending]
        if not left:
            return
        try:
            with parallel_config(**config), warnings.catch_warnings():
                warnings.simplefilter("ignore")     # joblib's note on a generator left early
                chunks = [left] if wave is None else [left[i:i + wave]
                                                      for i in range(0, len(left), wave)]
                for chunk in chunks:
                    tasks = (delayed(_analyse_one)(absolute[b], options, timeout, parent, cwd,
                                                   scratch) for b in chunk)
                    if wave is None:
                        results = Parallel(n_jobs=n_jobs, batch_size=1,
                                           return_as="generator_unordered")(tasks)
                    else:
                        results = Parallel(n_jobs=n_jobs, batch_size=1)(tasks)
                    for res in results:
                        b = back.get(res["bundle"], res["bundle"])
                        res = {**res, "bundle": b}
                        if "report" in res:
                            store.put(keys[b], res["report"])
                        for c in copies.get(b, [b]):
                            same = {"same_as": b} if c != b else {}
                            state.add({**res, "bundle": c, **same}, False)
                        state.write()
        except (_Interrupted, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - a worker lost (OOM, a node gone): retry once
            if attempt == 2:
                for b in [c for b in keys for c in copies.get(b, [b]) if c in state.pending]:
                    state.add({"bundle": b, "kind": "backend",
                               "error": f"the {config.get('backend')} backend failed twice "
                                        f"before this bundle finished (a worker lost?) "
                                        f"({type(e).__name__}: {str(e)[:200]})"}, False)
                state.write()


def _created(bundle: Path) -> str | None:
    """When the bundle was written (a multi-rank bundle written before the top manifest carried
    it: rank 0's part)."""
    for m in (bundle / MANIFEST, bundle / "rank0" / MANIFEST):
        try:
            if m.stat().st_size > _MAX_MANIFEST:
                continue
            created = json.loads(m.read_text()).get("created")
        except Exception:  # noqa: BLE001 - garbage, too deep, not an object: no date
            continue
        if isinstance(created, str):
            return created
    return None


def load_known(path: Path) -> set[str]:
    """Known signatures: a previous triage.json, or a text file with one signature a line."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"--known '{path}': {getattr(e, 'strerror', None) or e}; pass a "
                       "triage.json or a text file") from None
    try:
        return {g["signature"] for g in json.loads(text)["signatures"]}
    except (ValueError, KeyError, TypeError, RecursionError):
        return {line.strip() for line in text.splitlines() if line.strip()}


def to_markdown(data: dict) -> str:
    state = ("" if data.get("finished", True) else
             f" (running: {len(data.get('pending') or [])} bundle(s) still pending)")
    if data.get("interrupted"):
        state = f" (interrupted by {data['interrupted']})"
    lines = ["# nanbisect triage", "", f"{len(data['bundles'])} bundle(s) triaged, "
             f"{len(data['signatures'])} signature(s), {len(data['errors'])} error(s); exit "
             f"code {data['exit_code']}{state}.", "",
             "| count | signature (op, module, phase, dtypes, classification) | first seen | "
             "example | known |", "|---|---|---|---|---|"]
    for g in data["signatures"]:
        lines.append(f"| {g['count']} | `{g['signature']}` | {g['first_seen'] or '-'} | "
                     f"`{g['example']}` | {'yes' if g['known'] else '**new**'} |")
    if data["errors"]:
        lines += ["", "## Errors", ""] + [f"- `{e['bundle']}`: {e['error']}"
                                          for e in data["errors"]]
    clean = [b["bundle"] for b in data["bundles"] if b["signature"] is None]
    if clean:
        lines += ["", "## No failure", ""] + [f"- `{b}`" for b in clean]
    if data.get("pending"):
        lines += ["", "## Pending", ""] + [f"- `{b}`" for b in data["pending"]]
    if data.get("skipped"):
        lines += ["", "## Skipped (not bundles)", ""] + [f"- `{s['path']}`: {s['reason']}"
                                                         for s in data["skipped"]]
    if data.get("leftovers"):
        lines += ["", "## Leftovers of killed captures (`nanbisect clean` removes them)", ""] + [
            f"- `{x['path']}`: {x['bytes']} bytes, {x['age_s']:.0f} s old ({x['kind']})"
            for x in data["leftovers"]]
    return "\n".join(lines) + "\n"
