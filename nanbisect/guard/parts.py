"""The multi-rank bundle on disk: every rank writes its part (``rank{r}/``), the ranks agree with a
bounded wait on which parts made it, and the lowest rank whose part did adds the top manifest.

Guarantees: the bundle is complete, or it is marked partial (the top manifest's ``partial``:
``{"missing_ranks": [...], "reasons": {"<rank>": "..."}}``), or there is none and every rank
says why (`BundleNotWritten`); it is never lost on every rank because one rank failed. The ranks
meet in collectives only before anything is written (the staging directory's name, what is
written once for several ranks: `nanbisect.guard.coord`); from the first byte written they
agree through the process group's store (`nanbisect.guard.agree`), so a rank that exits, fails
(``ENOSPC``, or any exception of the writer: safetensors raises its own) or hangs while writing
holds the others at most ``NANBISECT_WRITE_TIMEOUT`` seconds (default 300) for its write and as
long again for its rescue, never the process group's timeout. A rank that cannot write its part
writes all of it (nothing taken from other ranks) into the rescue directory of its own host
(``$TMPDIR/nanbisect-rescue-UID/STEP-rank{r}``), and the reason and that path are in
``partial.reasons``. A part that takes tensors from a missing rank's part (DDP replicas are
written once, by the lowest rank) is written again whole, so that every part listed reads on its
own. SIGTERM (torchrun's agent stops every rank as soon as one fails, SIGKILL 30 s later) is held
back while the bundle is written, the wait is cut to 20 s after it, and it is delivered when the
bundle is in place.
Not guaranteed: a rank that hangs keeps its thread (the write cannot be interrupted); when that
write ends, it finds its place taken and removes what it wrote, but a process that dies first
leaves its hidden ``.STEP-rank{r}.tmp-XXXXXXXX`` in ``out`` (listed by ``inspect``, removed by
``nanbisect clean``). A rank that claimed its place and then lost its part before the top
manifest was written (a file system that drops a finished directory) is not detected.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from nanbisect.bundle.atomic import place
from nanbisect.bundle.format import MANIFEST, SCHEMA, environment, read_manifest, write_bundle
from nanbisect.guard.agree import Board, Clock, Running, held_sigterm, write_timeout
from nanbisect.guard.deadline import all_gather_objects
from nanbisect.guard.coord import (LISTED, broadcast_str, exchange, measured_or_not,
                                   merged_groups, out_of_sync, process_groups, rank_info, share,
                                   tensor_keys)
from nanbisect.util import torch_internals as ti
from nanbisect.util.files import file_sha256
from nanbisect.util.staging import make_staging_dir, staging_path, unmark
from nanbisect.util.text import exception_line

SHOWN = 8    # ranks named one by one in a message


class BundleNotWritten(RuntimeError):
    """No bundle could be put in place (no rank's part was written, or the top manifest could
    not be); the message says why, rank by rank, and where this rank's part went instead."""


class _Late(Exception):
    """This rank's outcome was decided without it (too late): its part must not go in."""


def rescue_dir() -> Path:
    """Where a bundle, or one rank's part, goes when its own place cannot take it: this user's
    private ``$TMPDIR/nanbisect-rescue-UID`` (made with mode 0700), used only while it is a real
    directory of this user that nobody else can write; otherwise (pre-created by someone else,
    a symlink, open to others) a new private directory beside it, never the squatted one.
    `OSError` when no private directory can be made."""
    tmp = Path(tempfile.gettempdir())
    path = tmp / f"nanbisect-rescue-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    if _private_dir(path):
        return path
    return Path(tempfile.mkdtemp(prefix=f"{path.name}-", dir=tmp))    # mode 0700, new


def _private_dir(path: Path) -> bool:
    """A real directory (not a link) owned by this user, not writable by group or others."""
    import stat
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def held_ranks(path: Path | None) -> list[int] | None:
    """The ranks a partial multi-rank bundle this process just wrote holds; None when it is
    complete (or unreadable: the bundle's own reader says why, later)."""
    try:
        top = read_manifest(path)
        return sorted(map(int, top["ranks"])) if top.get("partial") else None
    except Exception:  # noqa: BLE001 - only a hint for NonFiniteStep's message
        return None


def write_all_ranks(final: Path, build_part: Callable[[Path], tuple[dict, dict]],
                    manifest: dict, unique: bool = False, *,
                    replica_group: list[int] | None = None,
                    labels: dict[str, str] | None = None,
                    timeout: float | None = None) -> Path:
    """Every rank writes its part from ``build_part(dir) -> (manifest, tensors)``; the lowest
    rank whose part was written adds the top manifest and renames the staging directory to
    ``final``, never over an existing path (with ``unique``, the first free ``final-N``).
    Returns where it went, on every rank; `BundleNotWritten` when nothing could be put there.

    What is identical on several ranks is written once (`nanbisect.guard.coord.share`;
    ``replica_group`` and ``labels`` as there). ``timeout`` (default ``NANBISECT_WRITE_TIMEOUT``)
    bounds each rank's write and, twice over, the wait for another rank's outcome."""
    info = rank_info()
    timeout = write_timeout() if timeout is None else timeout
    with held_sigterm() as term:
        tmp = final.parent / broadcast_str(staging_path(final).name)
        refused = ""
        if info.rank == 0:
            try:     # with its marker: `nanbisect clean` may remove it
                make_staging_dir(tmp, parents=True)
            except Exception as e:  # noqa: BLE001 - every rank then rescues its part
                refused = f"the bundle's directory '{tmp}' could not be made ({exception_line(e)})"
        refused = broadcast_str(refused)   # also the barrier: the directory is there, or not
        part_manifest, tensors = build_part(tmp / f"rank{info.rank}")
        job = _Job(final, tmp, part_manifest, tensors, timeout, unique, Clock(term))
        try:   # the last collectives: nothing is written yet
            keys = tensor_keys(tensors)
            plan = exchange(keys, replica_group)
            kept, shared = share(plan, info.rank, keys, tensors)
            groups = all_gather_objects(process_groups(), "the gather of the process groups")
            rows, uncompared = out_of_sync(plan, labels or {})
        except Exception as e:  # noqa: BLE001 - a rank gone before the write: keep this one's
            job.lost(f"the ranks could not agree how to write it ({exception_line(e)})")
        top = {**manifest, "world_size": info.world_size, "backend": info.backend,
               "process_groups": merged_groups(groups, info.world_size),
               "replicas": {"groups": plan.groups(), "out_of_sync_count": len(rows),
                            "uncompared": uncompared}}
        try:
            return job.run(kept, shared, refused, top,
                           lambda: [measured_or_not(tmp, plan, row) for row in rows[:LISTED]])
        except BundleNotWritten:
            raise
        except Exception as e:  # noqa: BLE001 - the store itself failed: keep this rank's part
            job.lost(f"the ranks could not agree on it ({exception_line(e)})")


class _Job:
    """One rank's side of writing one multi-rank bundle."""

    def __init__(self, final: Path, tmp: Path, part_manifest: dict, tensors: dict,
                 timeout: float, unique: bool, clock: Clock):
        info = rank_info()
        self.final, self.tmp, self.unique = final, tmp, unique
        self.rank, self.world = info.rank, info.world_size
        self.pm, self.tensors, self.timeout = part_manifest, tensors, timeout
        self.dest = tmp / f"rank{self.rank}"
        beside = final.parent / f"{final.name}-rank{self.rank}"   # NB: outside the bundle
        self.staging = lambda: staging_path(beside)
        self.trash = staging_path(beside, "old")
        self.board = Board(dist.PrefixStore(f"nanbisect/{tmp.name}/",
                                            ti.default_store()),
                           self.rank)
        self.clock = clock
        self.host = socket.gethostname()
        self.rescued: dict | None = None   # where this rank's part went instead, once it did

    # -- the rounds ----------------------------------------------------------------------
    def run(self, kept: dict, shared: dict, refused: str, top: dict,
            measured: Callable[[], list]) -> Path:
        T, me, board = self.timeout, self.rank, self.board
        borrows = sorted({o for ref in shared.values()
                          for o in [ref["rank"], *map(int, ref.get("from", {}))]})
        t0 = time.monotonic()
        pm = {**self.pm, "shared": shared} if shared else self.pm
        self.own("write", lambda claim: write_bundle(
            self.dest, pm, kept, staging=self.staging(), claim=claim),
            {"ok": True, "borrows": borrows}, t0 + T, refused)
        got = board.gather("write", list(range(self.world)), t0 + 2 * T, self.clock,
                           self.late(t0))
        missing = {r for r, o in got.items() if not o["ok"]}
        if any(set(o.get("borrows") or ()) & missing for o in got.values() if o["ok"]):
            # a part that takes tensors from a missing one: written again, whole
            again = [r for r, o in got.items() if o["ok"] and o.get("borrows")]
            t1 = time.monotonic()
            if me in again:
                self.own("rewrite", self.rewrite, {"ok": True, "borrows": []}, t1 + T)
            got.update(board.gather("rewrite", again, t1 + 2 * T, self.clock, self.late(t1)))
        present = sorted(r for r, o in got.items() if o["ok"])
        missing_of = {r: o for r, o in sorted(got.items()) if not o["ok"]}
        if not present:
            shutil.rmtree(self.tmp, ignore_errors=True)    # empty: no part was placed
            raise BundleNotWritten(f"no rank could write its part of the bundle "
                                   f"'{self.final}': {self.reasons(missing_of)}")
        if me == present[0]:
            try:
                said = {"path": str(self.top(present, missing_of, top, measured))}
            except Exception as e:  # noqa: BLE001 - every rank then rescues its part
                said = {"error": f"rank {me} could not add the top manifest to '{self.tmp}' "
                                 f"({exception_line(e)})"}
            board.say("final", said)
        else:
            said = board.hear("final", time.monotonic() + 2 * T, self.clock) or {
                "error": f"rank {present[0]}, which was to add the top manifest, did not "
                         f"within {2 * T:g}s"}
        if "error" in said:
            where = self.rescued_text(self.rescued or self.rescue())
            raise BundleNotWritten(f"the bundle '{self.final}' could not be finished: "
                                   f"{said['error']}; {where}")
        path = Path(said["path"])
        if me == present[0] and missing_of:
            warnings.warn(f"Guard: the bundle {path} is partial: {self.reasons(missing_of)}; "
                          f"replay the ranks it holds with: nanbisect run {path} --ranks "
                          f"{','.join(map(str, present))}", RuntimeWarning, stacklevel=2)
        if self.clock.term() is not None:
            warnings.warn(f"Guard: SIGTERM came while the bundle {path} was written; it was held "
                          "back until now", RuntimeWarning, stacklevel=2)
        return path

    def own(self, name: str, write: Callable[[Callable[[], None]], Path], ok: dict, at: float,
            refused: str = "") -> None:
        """Write this rank's part (``write(claim)``; ``claim()`` just before it goes in place)
        by ``at``, and post the outcome of round ``name``; a part that is not in place by then
        goes to the rescue directory."""
        board = self.board
        ours = json.loads(board.raw(ok))

        def claim() -> None:
            if board.claim(name, ok) != ours:
                raise _Late(f"rank {self.rank}'s part came too late")

        run = None if refused else Running(lambda: write(claim))
        finished = run is None or run.wait(at, self.clock)
        if run is not None and finished and run.error is None:
            board.done(name)
            return
        reason = (refused if run is None else exception_line(run.error) if finished else
                  f"writing its part did not finish within {self.timeout:g}s "
                  "(NANBISECT_WRITE_TIMEOUT)")
        fail = {"ok": False, "reason": reason, "host": self.host}
        got = board.claim(name, fail)
        if got == ours:   # the write took its place a moment ago: let it end
            if run.wait(time.monotonic() + self.timeout, self.clock) and run.error is None:
                board.done(name)
                return
            got = board.claim(name, fail, over=ours)   # it failed (or hangs) after its claim
        mine = got == json.loads(board.raw(fail))
        if mine and name == "rewrite":   # the part written first takes tensors from a missing
            shutil.rmtree(self.dest, ignore_errors=True)     # rank's: it cannot stay either
            shutil.rmtree(self.trash, ignore_errors=True)
        self.rescued = self.rescue()
        done = {**fail, **self.rescued}
        if mine:
            board.claim(name, done, over=got)
            board.done(name)
        warnings.warn(f"Guard: rank {self.rank} could not write its part of the bundle into "
                      f"'{self.final.parent}' ({reason}); {self.rescued_text(done)}",
                      RuntimeWarning, stacklevel=3)

    def rewrite(self, claim: Callable[[], None]) -> Path:
        """This rank's whole part (every tensor, nothing taken from other ranks) in place of
        the one written first (which takes tensors from a missing rank's part: no use)."""
        os.rename(self.dest, self.trash)
        shutil.rmtree(self.trash, ignore_errors=True)
        return write_bundle(self.dest, self.pm, self.tensors, staging=self.staging(),
                            claim=claim)

    def late(self, start: float) -> Callable[[int], dict]:
        """The outcome of a rank that said nothing in a round started at ``start``."""
        def said_nothing(r: int) -> dict:
            cut = ", cut short by SIGTERM" if self.clock.until(start + 2 * self.timeout) < \
                start + 2 * self.timeout else ""
            return {"ok": False, "reason": f"no word from it within "
                                           f"{time.monotonic() - start:.0f}s: it exited, was "
                                           f"killed or hangs (the wait: twice "
                                           f"NANBISECT_WRITE_TIMEOUT={self.timeout:g}s{cut})"}
        return said_nothing

    # -- what is written -----------------------------------------------------------------
    def top(self, present: list[int], missing: dict[int, dict], top: dict,
            measured: Callable[[], list]) -> Path:
        """The top manifest (``partial`` when ranks are missing), then the rename into place."""
        for r in missing:   # a part that was not claimed is not in the bundle
            shutil.rmtree(self.tmp / f"rank{r}", ignore_errors=True)
        parts, saved = {}, [0, 0]
        for r in present:
            m = self.tmp / f"rank{r}" / MANIFEST
            pm = json.loads(m.read_text())   # a part this job's ranks just wrote, not an input
            parts[str(r)] = {"dir": f"rank{r}", "manifest_sha256": file_sha256(m),
                             "observed": pm.get("observed")}
            for ref in (pm.get("shared") or {}).values():
                saved[0], saved[1] = saved[0] + ref["bytes"], saved[1] + ref["tensors"]
        replicas = top["replicas"]
        full = {"schema": SCHEMA, "kind": "multi-rank",
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                "environment": environment(), **top, "ranks": parts,
                "replicas": {"groups": replicas["groups"], "shared_bytes": saved[0],
                             "shared_tensors": saved[1], "out_of_sync": measured(),
                             "out_of_sync_count": replicas["out_of_sync_count"],
                             "uncompared": replicas["uncompared"]},
                "files": {}}
        if missing:
            full["partial"] = {"missing_ranks": sorted(missing),
                               "reasons": {str(r): self.reason(o) for r, o in missing.items()}}
        with open(self.tmp / MANIFEST, "w") as f:
            f.write(json.dumps(full, indent=1, allow_nan=False))
            f.flush()
            os.fsync(f.fileno())
        unmark(self.tmp)
        return place(self.tmp, self.final, unique=self.unique)

    def rescue(self) -> dict:
        """This rank's whole part in the rescue directory: {rescued: path} or {rescue_error}."""
        target = rescue_dir() / f"{self.final.name}-rank{self.rank}"
        run = Running(lambda: write_bundle(target, self.pm, self.tensors, unique=True))
        if not run.wait(time.monotonic() + self.timeout, Clock()):
            return {"rescue_error": f"it did not finish within {self.timeout:g}s"}
        if run.error is not None:
            return {"rescue_error": f"{exception_line(run.error)} in '{target.parent}'"}
        return {"rescued": str(run.value)}

    def lost(self, why: str):
        """No bundle from this rank (the collectives before the write failed): its part is
        rescued and `BundleNotWritten` says where."""
        raise BundleNotWritten(f"the bundle '{self.final}' was not written: {why}; "
                               f"{self.rescued_text(self.rescue())}")

    # -- words ---------------------------------------------------------------------------
    def reason(self, o: dict) -> str:
        text = o.get("reason") or "its part was not written"
        if o.get("host"):
            text = f"on host {o['host']}: {text}"
        if o.get("rescued"):
            return f"{text}; its part was written to {o['rescued']} instead"
        if o.get("rescue_error"):
            return f"{text}; writing it to the rescue directory failed too ({o['rescue_error']})"
        return text

    def reasons(self, missing: dict[int, dict]) -> str:
        shown = [f"rank {r}: {self.reason(o)}" for r, o in list(missing.items())[:SHOWN]]
        more = len(missing) - SHOWN
        return "; ".join(shown) + (f"; and {more} more rank(s)" if more > 0 else "")

    def rescued_text(self, o: dict) -> str:
        if o.get("rescued"):
            return f"rank {self.rank}'s part was written to {o['rescued']} instead"
        if o.get("rescue_error"):
            return (f"rank {self.rank}'s part could not be written to the rescue directory "
                    f"either ({o['rescue_error']})")
        return f"rank {self.rank}'s part is in '{self.dest}'"
