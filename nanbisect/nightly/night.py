"""The run: discover, verify and look up every bundle, replay the rest through joblib, keep the
summary current, and stop cleanly on SIGTERM/SIGINT.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

from nanbisect import proc
from nanbisect.errors import BadInput, signal_name
from nanbisect.nightly.backends import connect_backend, jobs_for
from nanbisect.nightly.cache import Cache, cache_key
from nanbisect.nightly.find import check_outputs, check_roots, discover
from nanbisect.nightly.reports import copy_report, drop
from nanbisect.nightly.summary import NightState, TriageResult
from nanbisect.nightly.one_bundle import analyse_one
from nanbisect.util.numbers import NUMBERS, check_environment

DEFAULT_TIMEOUT = 1800.0            # seconds per bundle


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

    def handler(signum, frame):
        for s in sigs:                  # the second signal must not cut the summary's write
            proc.install(s, signal.SIG_IGN)
        raise _Interrupted(signum)

    with proc.handling(sigs, handler):
        yield


def triage(roots: list[Path], *, jobs: int | None = None, known: set[str] = frozenset(),
           cache: Path | None = None, options: dict | None = None, out: Path | None = None,
           timeout: float = DEFAULT_TIMEOUT, backend: str = "loky",
           scheduler: str | None = None, address: str | None = None,
           progress: Callable[[int, int], None] | None = None,
           notes: list[str] | None = None) -> TriageResult:
    """Triage every bundle under ``roots``; with ``out``, keep ``out/triage.json`` and
    ``out/triage.md`` current and cache in ``out/cache`` (or ``cache``: a directory several
    ``out`` share, such as one dated folder a night).

    ``progress(done, total)``, when given, is called in this thread once the bundles are found
    (``done`` 0) and after each bundle finishes (answered from the cache, an error row, or
    replayed), ``total`` the bundles found; an exception it raises is ignored. ``notes``: lines
    the summary carries (triage.json's ``notes``), such as a ``--known`` file that does not
    exist yet.

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
    check_roots(roots)
    timeout = float(NUMBERS["--timeout"].check(timeout, "triage"))
    if jobs is not None:
        NUMBERS["--jobs"].check(jobs, "triage")
    check_environment("triage")     # every replay reads them: a bad one, before the first
    out = None if out is None else Path(out)
    cache = Path(cache) if cache is not None else None if out is None else out / "cache"
    check_outputs(out, cache)
    options = {"reference": "none", **(options or {})}
    previous = _last_night(out)
    state = NightState(roots, set(known), out, options, backend, timeout,
                   previous=previous if previous is not None or not known else set(known),
                   progress=progress, notes=list(notes or []))
    store = Cache(cache)
    with _interruptible():
        try:
            _night(roots, state, store, out, cache, options, timeout,
                   (backend, scheduler, address, jobs))
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


def _night(roots: list[Path], state: NightState, store: Cache, out: Path | None,
           cache: Path | None, options: dict, timeout: float, how: tuple) -> None:
    """Discover the bundles, answer what the cache knows and replay the rest (``how``:
    backend, scheduler, address, jobs), writing the summary as it goes."""
    from nanbisect.bundle.leftovers import find_leftovers

    backend, scheduler, address, jobs = how
    bundles, state.skipped = discover(roots, exclude=tuple(p for p in (out, cache) if p))
    state.pending = {str(b) for b in bundles}
    state.tell()
    try:
        state.leftovers = [x.to_json() for x in find_leftovers(roots, beside=bundles)]
    except Exception as e:  # noqa: BLE001 - a listing problem must not stop the night
        state.leftovers = [{"path": "", "bytes": 0, "age_s": 0.0, "kind": "error",
                            "error": f"{type(e).__name__}: {str(e)[:200]}"}]
    with connect_backend(backend, scheduler, address, jobs) as (config, n_jobs, wave):
        _first_write(out, cache, state)
        todo = _lookup(bundles, options, store, state)
        state.write()
        todo, copies = _copies(todo)
        if todo:
            if backend == "loky":
                n_jobs = jobs_for([Path(b) for b, _ in todo], n_jobs)
            _replay(todo, copies, options, timeout, config, n_jobs, wave, store, state)


def _last_night(out: Path | None) -> set[str] | None:
    """The signatures of the summary an earlier run left in ``out`` (what "new since the last
    night" is measured against; without one, ``--known``'s), None when there is none."""
    from nanbisect.util.files import read_json

    data = None if out is None else read_json(out / "triage.json", 64 << 20)
    sigs = data.get("signatures") if isinstance(data, dict) else None
    if not isinstance(sigs, list):
        return None
    return {g["signature"] for g in sigs if isinstance(g, dict)
            and isinstance(g.get("signature"), str)}


def _first_write(out: Path | None, cache: Path | None, state: NightState) -> None:
    """Create ``out`` and ``cache`` and write the night's summary once, strictly: a full or
    read-only --out, or a --cache that cannot be made, fails now (`BadInput`, the directories
    made for them removed again), not after the replays."""
    made = []
    try:
        for d, flag in ((out, "--out"), (cache, "--cache")):
            if d is None:
                continue
            made += [p for p in (d, *d.absolute().parents) if not p.exists() and p not in made]
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise BadInput(f"triage: cannot create {flag} '{d}' ({e.strerror}); "
                               "pass a writable directory") from None
        state.write(final=True)
    except BadInput:
        for d in sorted(made, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def _copies(todo: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], dict[str, list[str]]]:
    """Bundles with the same key (copies: the same content, code and options) are replayed
    once; the others take its result. (first of each key, first -> all of its copies)"""
    first: dict[str, str] = {}
    copies: dict[str, list[str]] = {}
    for b, key in todo:
        copies.setdefault(first.setdefault(key, b), []).append(b)
    return [(b, k) for k, b in first.items()], copies


def _lookup(bundles: list[Path], options: dict, store: Cache, state: NightState
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
        src, dest = store.report_dir(key), state.report_path(name)
        if hit is not None and (src is not None or dest is None):
            # NB: a hit whose report copy is gone (the cache could not keep it) is replayed
            # instead: the night keeps a report of every bundle
            why = None if dest is None else copy_report(src, dest)
            kept = {} if dest is None else {"report_dir": str(dest)} if why is None else \
                {"report_error": why}
            if why is not None:
                drop(dest)
            state.add({"bundle": name, "report": hit, **kept,
                       "seconds": round(time.monotonic() - t0, 2)}, True)
        else:
            todo.append((name, key))
    return todo


def _replay(todo: list[tuple[str, str]], copies: dict[str, list[str]], options: dict,
            timeout: float, config: dict, n_jobs: int, wave: int | None, store: Cache,
            state: NightState) -> None:
    """Run the replays through joblib; each result is cached and written as it arrives (for
    the bundle and its ``copies``). A backend failure (a worker lost) retries what did not
    finish, once. The replays' scratch directories go in one of this run's, removed at the end
    (on SIGTERM/SIGINT too; after kill -9, each replay's guardian removes its own, and the
    run's goes once its lock is free)."""
    keys = dict(todo)
    _sweep_scratch(timeout)
    # NB: the pid in the name is for people; whether the run is alive is its lock's to say
    with proc.locked(f"nanbisect-triage-{os.getpid()}-") as scratch:
        _replay_all(keys, copies, options, timeout, config, n_jobs, wave, store, state,
                    str(scratch))


def _keep(state: NightState, bundle: str) -> str | None:
    """Where the replay of ``bundle`` keeps its report (absolute: a worker's cwd may differ)."""
    dest = state.report_path(bundle)
    return None if dest is None else str(dest.absolute())


def _sweep_scratch(timeout: float) -> None:
    """Remove what killed runs left in the temporary directory: a scratch directory
    (``nanbisect-triage-[PID-]*``) whose lock (`nanbisect.proc.locked`) no live process holds
    (kill -9 of triage while a replay was still starting, before its guardian existed),
    whatever pid its name holds: a triage in another PID namespace sharing ``$TMPDIR`` holds
    its lock as well as one here, and a dead run's pid may have gone to an unrelated process.
    One without a lock (an older nanbisect's, or killed before its lock existed) goes only
    when older than a day and than twice ``timeout``."""
    proc.sweep(r"nanbisect-triage-(?:(\d+)-)?[a-z0-9_]{8}",
               unlocked_after=max(86400, 2 * timeout))


def _replay_all(keys: dict[str, str], copies: dict[str, list[str]], options: dict,
                timeout: float, config: dict, n_jobs: int, wave: int | None, store: Cache,
                state: NightState, scratch: str) -> None:
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
                    tasks = (delayed(analyse_one)(absolute[b], options, timeout, parent, cwd,
                                                   scratch, _keep(state, b)) for b in chunk)
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
                            if res.get("report_dir"):
                                store.put_dir(keys[b], Path(res["report_dir"]))
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
