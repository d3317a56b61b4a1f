"""The bundle on disk: a directory with ``manifest.json`` and ``.safetensors`` files.

Guarantees: a bundle is written into a hidden temporary directory beside its final path and renamed
into place only when every file and the manifest are on disk, so a crash never leaves a directory
that looks valid; its files get the permissions of the user's umask (0644 under umask 022), also
the tensor files, which safetensors itself writes 0600. Every file's sha256 is in the manifest and
checked on load. Reading a bundle parses JSON and safetensors only: it never unpickles and never
imports user code, and it is bounded in time and memory whatever the manifest or a safetensors
header claims (`read_bundle`, `read_header`: size, JSON values and depth, world size, tensor
count, offsets against the file's real size); a malformed manifest, header, field type, symbolic
link or part directory outside the bundle is a `BadInput` naming the file and the fix. It is the
one validation `run` and `inspect` share: JSON without NaN or Infinity, every section's known keys
typed (`nanbisect.bundle.schema`), and what the manifest names checked against the headers
(`nanbisect.bundle.check`), all before any file is hashed.
A part of a multi-rank bundle may take tensors from lower ranks' files (its manifest's
``shared``, see `_borrowed`); `Bundle.part` resolves them to the owner's file, verified by its
sha256, and refuses a reference to a rank, file or tensor that is not there, to a rank that is
not lower, to batch or RNG, or to any name that is not a plain tensor file of a part. Bundles
without ``shared`` read as before. A multi-rank bundle whose top manifest has ``partial``
(`nanbisect.bundle.schema.check_partial`: ranks that could not write their parts when it was
captured) lists only the other parts; asking for a missing rank's part is a `BadInput` naming it.
This module is the reader; the writer is `nanbisect.bundle.writer`, the bounded parsing of files
nobody vouches for `nanbisect.bundle.bounded`, the manifest's field checks
`nanbisect.bundle.schema`; their public names are re-exported here.
Not guaranteed: protection against a deliberately forged manifest whose checksums were recomputed
(such a bundle replays whatever tensors it holds; `inspect` stays safe); a file swapped between
the checks and the load (a bundle being rewritten while it is read); time to hash files that are
really as large as they are (a sparse 1 TB file is hashed, slowly).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from nanbisect import __version__
from nanbisect.bundle.bounded import (DTYPE_BITS, MAX_HEADER_BYTES, MAX_JSON_DEPTH,
                                     MAX_JSON_ITEMS, MAX_MANIFEST_BYTES, MAX_NDIM, MAX_TENSORS,
                                     MAX_WORLD_SIZE, RECOPY_FIX, add_lazy, is_uint, kind_of,
                                     load_tensors, parse_json, read_header, regular_file)
from nanbisect.bundle.lazy import Layered, LazyTensors
from nanbisect.bundle import codestore
from nanbisect.bundle.check import check_state
from nanbisect.bundle.where import check_bundle_dir
from nanbisect.bundle.schema import (LAZY_ROLES, MANIFEST, PER_RANK, REQUIRED, REQUIRED_MULTI,
                                    ROLES, SCHEMA, SCHEMA_VERSION, SUFFIX, check_fields,
                                    check_partial, check_replicas, check_section, field_problem,
                                    is_int, is_strs, safe_name)
from nanbisect.bundle.state import Tensors
from nanbisect.bundle.writer import environment, umask_mode, write_bundle
from nanbisect.errors import BadInput
from nanbisect.util.files import file_sha256 as _sha256
from nanbisect.util.numbers import env
from nanbisect.util.text import ranks_arg, show

# the bundle's reader; its writer (`writer`), the bounded parsing of untrusted files (`bounded`)
# and the manifest's schema (`schema`) are re-exported here, where callers have always found them
__all__ = ["DTYPE_BITS", "MANIFEST", "MAX_HEADER_BYTES", "MAX_JSON_DEPTH", "MAX_JSON_ITEMS",
           "MAX_MANIFEST_BYTES", "MAX_NDIM", "MAX_TENSORS", "MAX_WORLD_SIZE", "PER_RANK", "ROLES",
           "SCHEMA", "SCHEMA_VERSION", "SUFFIX", "Bundle", "environment", "field_problem",
           "parse_json", "read_bundle", "read_header", "read_manifest", "show", "umask_mode",
           "write_bundle"]


@dataclass(frozen=True)
class Bundle:
    """A bundle whose manifest and checksums have been verified.

    The part of a rank that wrote some tensors once for several ranks (its manifest's
    ``shared``) is opened through its multi-rank bundle (`part`), which resolves and checks
    those references: ``borrowed`` maps a tensor file to ``[(owner part directory, names)]``.
    """

    path: Path
    manifest: dict
    borrowed: dict | None = field(default=None, repr=False, compare=False)
    # a multi-rank bundle's owner parts: manifests, headers, files verified (`_borrowed`)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def tensors(self, role: str) -> Tensors:
        """The tensors of ``role`` (`BadInput` unless the file is a sound safetensors file),
        those this part takes from lower ranks' parts included (from their own files, which
        `part` verified by their sha256)."""
        name = f"{role}{SUFFIX}"
        out = (load_tensors(self.path / name, f"bundle '{self.path}': {name}",
                            checked=("head", str(self.path / name)) in self._cache)
               if name in self.manifest["files"] else {})
        ref = (self.manifest.get("shared") or {}).get(name)
        if ref is None:
            return out
        if self.borrowed is None:
            n = ref.get("tensors") if isinstance(ref, dict) else None
            raise BadInput(f"bundle '{self.path}' is one rank's part of a multi-rank bundle and "
                           f"takes {n if is_uint(n) else 'some'} tensors of {name} from a lower "
                           f"rank's part; open the whole bundle (nanbisect run "
                           f"'{self.path.parent}'), not one part")
        for owner, names in self.borrowed.get(name, []):
            out.update(load_tensors(owner / name,
                                    f"bundle '{owner.parent}': {owner.name}/{name}", names))
        return out

    def header(self, name: str) -> dict[str, dict]:
        """The safetensors header of this bundle's file ``name`` (`read_header`): the one
        `read_bundle` read while verifying it when it kept it, else read now; e.g.
        ``b.header("model.safetensors")["w"]["shape"]`` -> ``[4, 4]``."""
        return self._cache.get(("head", str(self.path / name))) or \
            read_header(self.path / name, f"bundle '{self.path}': {name}")

    def all_tensors(self) -> Tensors:
        out: Tensors = {}
        for role in ROLES:
            out.update(self.tensors(role))
        return out

    def state_tensors(self) -> "Layered":
        """Every role's tensors, the model's and optimizer's read from their files when asked
        (`nanbisect.bundle.lazy`: a replay never holds the state twice), the others loaded."""
        lazy, small = LazyTensors(), {}
        for role in ROLES:
            if role not in LAZY_ROLES:
                small.update(self.tensors(role))
                continue
            name = f"{role}{SUFFIX}"
            if name in self.manifest["files"]:
                add_lazy(lazy, self.path / name, f"bundle '{self.path}': {name}")
            ref = (self.manifest.get("shared") or {}).get(name)
            if ref is not None:
                if self.borrowed is None:
                    self.tensors(role)     # the error: one part of a multi-rank bundle
                for owner, names in self.borrowed.get(name, []):
                    add_lazy(lazy, owner / name, f"bundle '{owner.parent}': {owner.name}/{name}",
                             names)
        return Layered(small, lazy)

    @property
    def world_size(self) -> int:
        return int(self.manifest.get("world_size") or 1)

    @property
    def multi_rank(self) -> bool:
        return self.manifest.get("kind") == "multi-rank"

    @property
    def missing_ranks(self) -> list[int]:
        """The ranks whose parts a partial multi-rank bundle lacks (its top manifest's
        ``partial``, checked by `read_bundle`); [] for a complete bundle."""
        partial = self.manifest.get("partial")
        return list((partial.get("missing_ranks") or []) if isinstance(partial, dict) else [])

    def part(self, rank: int, verify: bool = True) -> "Bundle":
        """The verified part of one rank of a multi-rank bundle; the tensors it takes from lower
        ranks' parts are resolved and checked (the owner's file holds each one; with
        ``verify``, the owner's manifest and file match their sha256)."""
        info = self.manifest["ranks"].get(str(rank))
        if info is None:     # a partial bundle (`read_bundle` checked it lists the others)
            why = ((self.manifest.get("partial") or {}).get("reasons") or {}).get(str(rank))
            held = ranks_arg(int(r) for r in self.manifest["ranks"])
            raise BadInput(f"bundle '{self.path}' is partial: rank {rank} could not write its "
                           f"part{f' ({show(why, 300)})' if why else ''}; replay the ranks it "
                           f"holds with --ranks {held}")
        if verify:   # also when the whole bundle was opened without verifying (``--ranks``)
            d = self.path / info["dir"]
            if os.path.islink(d):
                raise BadInput(f"bundle '{self.path}': the part of rank {rank} ({info['dir']}) is "
                               "a symbolic link; a bundle holds only plain directories: "
                               "re-capture the bundle")
            if (d / MANIFEST).is_file() and \
                    _sha256(d / MANIFEST) != info.get("manifest_sha256"):
                raise BadInput(f"bundle '{self.path}': the manifest of rank {rank} does not match "
                               "its sha256 in the top manifest; re-capture the bundle")
        b = read_bundle(self.path / info["dir"], verify, _part=rank)
        if not b.manifest.get("shared"):
            return b
        borrowed = _borrowed(self, rank, b, verify)
        if verify:
            _check_lent(self, b, borrowed)
        return replace(b, borrowed=borrowed)


def read_manifest(path: str | Path) -> dict:
    """The manifest.json of the bundle (or multi-rank top) at ``path``, read within the bounds
    of an untrusted file (size, JSON values and depth) with its schema checked, and nothing else
    of the bundle: `BadInput` naming the problem otherwise. Every read of a manifest goes
    through here (or `read_bundle`, which does)."""
    return _read_manifest(Path(path))


def _read_manifest(p: Path) -> dict:
    check_bundle_dir(p)     # exists, a directory, holds manifest.json (else: a folder of bundles?)
    mpath = p / MANIFEST
    st = regular_file(mpath, f"bundle '{p}': manifest.json")
    limit = env("NANBISECT_MAX_MANIFEST_BYTES", MAX_MANIFEST_BYTES)
    if st.st_size > limit:
        raise BadInput(f"bundle '{p}': manifest.json has {st.st_size} bytes, more than the "
                       f"{limit} nanbisect reads; re-capture the bundle (a real one this big: "
                       "raise NANBISECT_MAX_MANIFEST_BYTES)")
    try:
        with open(mpath, "rb") as f:
            raw = f.read(st.st_size + 1)   # NB: not limit + 1: read(n) allocates n bytes
    except OSError as e:
        raise BadInput(f"bundle '{p}': manifest.json cannot be read ({e.strerror}); {RECOPY_FIX}") \
            from None
    if len(raw) > limit:
        raise BadInput(f"bundle '{p}': manifest.json grew past {limit} bytes while being "
                       "read; re-capture the bundle")
    manifest = parse_json(raw, f"bundle '{p}': manifest.json", "re-capture the bundle")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("schema"), str) or \
            not manifest["schema"].startswith("nanbisect.bundle/"):
        raise BadInput(f"bundle '{p}': manifest.json has no 'nanbisect.bundle/N' schema; it was "
                       "not written by nanbisect; re-capture the bundle")
    version = manifest["schema"].split("/", 1)[1]
    if not (version.isascii() and version.isdigit() and len(version) < 10):
        raise BadInput(f"bundle '{p}': unreadable schema {show(manifest['schema'])}; re-capture "
                       "the bundle")
    if int(version) > SCHEMA_VERSION:
        raise BadInput(f"bundle '{p}' uses schema {int(version)}, newer than this nanbisect "
                       f"({__version__}, schema {SCHEMA_VERSION}) reads; upgrade nanbisect")
    return manifest


def read_bundle(path: str | Path, verify: bool = True, *, _part: int | None = None) -> Bundle:
    """Open and verify a bundle directory; raise `BadInput` naming the problem and the fix.

    Bounded whatever the manifest claims: the manifest is at most `MAX_MANIFEST_BYTES` (and
    `MAX_JSON_ITEMS` values, `MAX_JSON_DEPTH` deep), every field `read_bundle` or `inspect`
    uses has the type the writer gives it, nothing is allocated per claimed rank before the parts
    are counted, and no file of the bundle (the manifest, a tensor file, a rank's part) may be a
    symbolic link or lie outside the bundle directory. ``verify`` also checks every listed file's
    size and sha256 (reading each file once).

    >>> read_bundle("fixtures/bundles/healthy").manifest["entry"]
    'fixtures/tasks/healthy.py:task'
    """
    p = Path(path)
    manifest = _read_manifest(p)
    cache: dict = {}
    if manifest.get("kind") == "multi-rank":
        if _part is not None:
            raise BadInput(f"bundle '{p}': the part of rank {_part} is itself a multi-rank bundle; "
                           "re-capture the bundle")
        return _read_multi(p, manifest, verify)
    check_fields(p, manifest, REQUIRED)
    if _part is not None and manifest.get("rank") not in (None, _part):
        raise BadInput(f"bundle '{p}': the part listed for rank {_part} says it is rank "
                       f"{manifest['rank']}; re-capture the bundle")
    for name, info in manifest["files"].items():
        if not safe_name(name) or name == MANIFEST:
            raise BadInput(f"bundle '{p}': the manifest lists file {show(name)}, which is not a "
                           "plain file name in the bundle directory; re-capture the bundle")
        if not (isinstance(info, dict) and isinstance(info.get("sha256"), str)
                and is_uint(info.get("bytes"))):
            raise BadInput(f"bundle '{p}': the manifest's entry for {show(name)} is "
                           f"{kind_of(info)}, not {{sha256: string, bytes: integer}}; re-capture "
                           "the bundle")
    codestore.check(p, manifest, verify=False)   # stored code: paths inside code/ only
    if verify:
        # NB: the cheap checks of every file first (sizes, headers, what the manifest names in
        # them), the hashing last: a wrong size or a hostile header is refused in milliseconds,
        # never after hashing the files before it
        for name, info in manifest["files"].items():
            f = p / name
            if not os.path.lexists(f):
                raise _missing(p, name)
            st = regular_file(f, f"bundle '{p}': {name}")
            if st.st_size != info["bytes"]:
                raise BadInput(f"bundle '{p}': {name} does not match its sha256 in the manifest "
                               f"({st.st_size} bytes, the manifest says {info['bytes']}: "
                               "truncated or altered); copy the bundle again or re-capture it")
        try:
            heads = _heads(p, manifest, cache)
            if not manifest.get("shared"):   # a part that borrows: checked by `Bundle.part`
                check_state(p, manifest, heads)
        except BadInput:
            # a damaged file is named as such, not by what it broke; but only the small ones
            # are hashed for that: a hostile bundle is refused in bounded time
            _check_hashes(p, manifest, RECHECK_BYTES)
            raise
        _check_hashes(p, manifest)
        codestore.check(p, manifest, verify=True)
    # the headers just checked are kept: `Bundle.tensors` and `inspect` do not read them again
    return Bundle(p, manifest, _cache=cache)


RECHECK_BYTES = 1 << 28
PACK_HEAD = "pack.json"


def _missing(p: Path, name: str) -> BadInput:
    """A listed file that is not there: in a ticket unpacked from ``nanbisect pack`` without
    ``--full`` (its ``pack.json`` says so), what the ticket holds instead; else copy it whole."""
    ticket = p.parent if p.name == "bundle" else p.parent.parent
    head = ticket / PACK_HEAD
    full = None
    try:
        if head.is_file() and head.stat().st_size <= 32 << 20:
            full = parse_json(head.read_bytes(), f"'{head}'", "").get("full")
    except (OSError, BadInput, AttributeError):
        full = None
    if full is False:
        repro = ticket / "report" / "repro" / "repro.py"
        return BadInput(f"bundle '{p}' was packed without --full: its model and optimizer state "
                        f"are not in it; run its repro ({repro}) or ask for `nanbisect pack "
                        "--full`")
    return BadInput(f"bundle '{p}': file '{name}' listed in the manifest is missing; copy the "
                    "whole bundle directory or re-capture it")


def _check_hashes(p: Path, manifest: dict, limit: int | None = None) -> None:
    for name, info in manifest["files"].items():
        if limit is not None and info["bytes"] > limit:
            continue
        if _sha256(p / name) != info["sha256"]:
            raise BadInput(f"bundle '{p}': {name} does not match its sha256 in the manifest "
                           "(truncated or altered); copy the bundle again or re-capture it")


def _heads(p: Path, manifest: dict, cache: dict | None = None) -> dict[str, dict]:
    """The safetensors headers of a bundle's tensor files (file name -> header), each read once
    per ``cache``."""
    out = {}
    for name in manifest["files"]:
        if name.endswith(SUFFIX):
            key = ("head", str(p / name))
            if cache is None or key not in cache:
                head = read_header(p / name, f"bundle '{p}': {name}")
                if cache is None:
                    out[name] = head
                    continue
                cache[key] = head
            out[name] = cache[key]
    return out


def _check_lent(top: "Bundle", part: "Bundle", borrowed: dict) -> None:
    """`check_state` of a part that takes tensors from lower ranks' files (``borrowed``, as
    `_borrowed` resolved it), with their header entries."""
    lent: dict[str, dict] = {}
    for name, owners in borrowed.items():
        for owner_dir, names in owners:
            key = ("head", str(owner_dir / name))
            if key not in top._cache:
                top._cache[key] = read_header(owner_dir / name,
                                              f"bundle '{top.path}': {owner_dir.name}/{name}")
            head = top._cache[key]
            lent.setdefault(name, {}).update({n: head[n] for n in names})
    check_state(part.path, part.manifest, _heads(part.path, part.manifest, part._cache), lent)


def _read_multi(p: Path, manifest: dict, verify: bool) -> Bundle:
    """A multi-rank bundle: the top manifest names one verified part per rank."""
    check_fields(p, manifest, REQUIRED_MULTI)
    ranks, world = manifest["ranks"], manifest["world_size"]
    if world is None:
        raise BadInput(f"bundle '{p}': the top manifest's world_size is null, not an integer from "
                       f"1 to {MAX_WORLD_SIZE}; re-capture the bundle")
    # NB: compare counts first: nothing is built per claimed rank before the parts are counted
    top_partial = manifest.get("partial")
    missing = check_partial(p, top_partial if isinstance(top_partial, dict) else None, world,
                            ranks)
    if not ranks or len(ranks) + len(missing) != world or \
            not set(ranks) <= set(map(str, range(world))):
        raise BadInput(f"bundle '{p}': the top manifest lists {len(ranks)} parts, not one per "
                       f"rank 0..{world - 1} of its world size {world}"
                       f"{f' (with {len(missing)} missing)' if missing else ''}; re-capture the "
                       "bundle")
    dirs = []
    for r, info in ranks.items():
        d = info.get("dir") if type(info) is dict else None
        if type(d) is not str or (d != "rank" + r and not safe_name(d)):
            raise BadInput(f"bundle '{p}': the top manifest's entry for rank {r} has no plain "
                           f"directory name in the bundle ('dir': {show(d)}); parts outside the "
                           "bundle are refused: re-capture the bundle")
        if type(info.get("manifest_sha256", "")) is not str:
            raise BadInput(f"bundle '{p}': the top manifest's manifest_sha256 of rank {r} is not a "
                           "string; re-capture the bundle")
        check_section(p, "observed", info.get("observed"), f"ranks.{r}.observed")
        if verify:      # here, not after the loop: a copy without its parts is refused at once
            _part_there(p, r, d)
        dirs.append(d)
    if len(set(dirs)) != len(dirs):
        seen: set = set()
        dup = next(d for d in dirs if d in seen or seen.add(d))
        raise BadInput(f"bundle '{p}': ranks share the part directory {show(dup)}; "
                       "re-capture the bundle")
    if verify:
        for r, info in ranks.items():
            d = p / info["dir"]
            regular_file(d / MANIFEST, f"bundle '{p}': the manifest of rank {r}")
            if _sha256(d / MANIFEST) != info.get("manifest_sha256"):
                raise BadInput(f"bundle '{p}': the manifest of rank {r} does not match its "
                               "sha256 in the top manifest; re-capture the bundle")
            read_bundle(d, verify=True, _part=int(r))
    check_replicas(p, manifest.get("replicas"))
    top = Bundle(p, manifest)
    if verify:   # every part's references to lower ranks' tensors resolve (files just verified)
        for r, info in ranks.items():
            part = read_bundle(p / info["dir"], verify=False, _part=int(r))
            if part.manifest.get("shared"):
                _check_lent(top, part, _borrowed(top, int(r), part, verify=False))
    return top


def _part_there(p: Path, rank: str, d: str) -> None:
    """`BadInput` unless rank ``rank``'s part ``d`` is a plain directory with a manifest."""
    if os.path.islink(p / d):
        raise BadInput(f"bundle '{p}': the part of rank {rank} ({d}) is a symbolic link; a "
                       "bundle holds only plain directories: re-capture the bundle")
    if not (p / d / MANIFEST).is_file():
        raise BadInput(f"bundle '{p}': the part of rank {rank} ({d}) is missing; copy the whole "
                       "bundle directory or re-capture it")


def _borrowed(top: Bundle, rank: int, part: Bundle, verify: bool) -> dict:
    """Resolve a part's ``shared``: tensor file -> [(owner part directory, tensor names)].

    A part's ``shared[FILE] = {"rank": D, "tensors": N, "bytes": B, "from": {"R": [names]},
    "skip": [names]}`` says: the part's tensors of FILE are those of its own FILE (if any), the
    ``from`` names taken from rank R's FILE, and every other tensor of rank D's FILE except
    ``skip``; N tensors come from other ranks in all. Owners are lower ranks of the same bundle
    (no chains: an owner writes what it owns), FILE is a plain ``.safetensors`` name and never
    batch or RNG, the owner's part lists FILE and its header holds every name, and the count
    matches: anything else is `BadInput`. Bounded: one header read per (owner, file), cached
    on ``top``; with ``verify`` the owner's manifest and FILE are checked against their sha256.
    """
    shown = f"bundle '{top.path}': the part of rank {rank}"
    ranks = top.manifest["ranks"]
    out: dict[str, list] = {}
    for name, ref in part.manifest["shared"].items():
        _check_shared_entry(name, ref, shown)
        own_head = (read_header(part.path / name, f"bundle '{part.path}': {name}")
                    if name in part.manifest["files"] else {})
        own = set(own_head) - {"__metadata__"}
        default = ref["rank"]
        taken: list[tuple[int, list[str]]] = [(int(k), v) for k, v in ref.get("from", {}).items()]
        named: set = set()
        for n in (n for _, v in taken for n in v):
            if n in own or n in named:
                raise BadInput(f"{shown} has tensor {show(n)} of {name} twice (in its own file "
                               f"and another rank's, or in two ranks'); {_PART_FIX}")
            named.add(n)
        for owner in [default, *(o for o, _ in taken)]:
            _check_owner(top, owner, rank, name, shown)
        heads = {o: _owner_names(top, o, name, shown, verify) for o in {default, *dict(taken)}}
        for o, names in taken:
            missing = next((n for n in names if n not in heads[o]), None)
            if missing is not None:
                raise BadInput(f"{shown} takes tensor {show(missing)} of {name} from rank {o}, "
                               f"whose {name} does not hold it; {_PART_FIX}")
        skip = set(ref.get("skip", []))
        rest = [n for n in heads[default] if n not in own and n not in named and n not in skip]
        if len(rest) + len(named) != ref["tensors"]:
            raise BadInput(f"{shown} takes {ref['tensors']} tensors of {name} from lower ranks, "
                           f"but their files provide {len(rest) + len(named)}; {_PART_FIX}")
        dirs = {o: top.path / ranks[str(o)]["dir"] for o in heads}
        out[name] = [(dirs[default], rest)] * bool(rest) + [(dirs[o], v) for o, v in taken if v]
    return out


_PART_FIX = "the manifest was altered or damaged: re-capture the bundle"


def _check_shared_entry(name: str, ref, shown: str) -> None:
    """`BadInput` unless a part's ``shared[name]`` names a tensor file other than batch or RNG
    and has the entry's form."""
    fix = _PART_FIX
    if not (safe_name(name) and name.endswith(SUFFIX)) or name == MANIFEST:
        raise BadInput(f"{shown} takes tensors of {show(name)} from another rank's part, "
                       "which is not a tensor file name of a part (parts outside the bundle "
                       f"are refused); {fix}")
    if name[:-len(SUFFIX)] in PER_RANK:
        raise BadInput(f"{shown} takes {name} from another rank's part, but every rank "
                       f"writes its batch and RNG itself; {fix}")
    frm = ref.get("from", {}) if isinstance(ref, dict) else None
    if not (isinstance(ref, dict) and is_int(ref.get("rank")) and is_uint(ref.get("tensors"))
            and isinstance(frm, dict) and all(is_strs(v) for v in frm.values())
            and all(isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 10
                    for k in frm) and is_strs(ref.get("skip", []))):
        raise BadInput(f"{shown}: its 'shared' entry for {name} is not {{rank: integer, "
                       "tensors: integer, from: {rank: [names]}, skip: [names]}; " + fix)


def _check_owner(top: Bundle, owner: int, rank: int, name: str, shown: str) -> None:
    """`BadInput` unless ``owner``, whose ``name`` rank ``rank``'s part takes tensors of, is a
    lower rank of the bundle whose part it has."""
    world, ranks = top.world_size, top.manifest["ranks"]
    if not 0 <= owner < world:
        raise BadInput(f"{shown} takes tensors of {name} from rank {owner}, which is not "
                       f"a rank of this bundle (world size {world}); {_PART_FIX}")
    if str(owner) not in ranks:
        raise BadInput(f"{shown} takes tensors of {name} from rank {owner}, whose part "
                       f"this partial bundle lacks; {_PART_FIX}")
    if owner >= rank:
        raise BadInput(f"{shown} takes tensors of {name} from rank {owner}, not a lower "
                       f"rank (the lowest rank holding them writes them); {_PART_FIX}")


def _owner_names(top: Bundle, owner: int, name: str, shown: str, verify: bool) -> list[str]:
    """The tensor names in rank ``owner``'s ``name`` (cached on ``top``)."""
    key = (owner, name, verify)
    if key in top._cache:
        return top._cache[key]
    info = top.manifest["ranks"][str(owner)]
    d = top.path / info["dir"]
    where = f"{shown} takes tensors of {name} from rank {owner}"
    if os.path.islink(d) or not (d / MANIFEST).is_file():
        raise BadInput(f"{where}, whose part ({info['dir']}) is missing or a link; copy the whole "
                       "bundle directory or re-capture it")
    m = top._cache.get(("manifest", owner))
    if m is None:
        if verify and _sha256(d / MANIFEST) != info.get("manifest_sha256"):
            raise BadInput(f"{where}, whose manifest does not match its sha256 in the top "
                           "manifest; re-capture the bundle")
        m = _read_manifest(d)
        check_fields(d, m, REQUIRED)
        top._cache[("manifest", owner)] = m
    entry = m["files"].get(name)
    if not isinstance(entry, dict):
        raise BadInput(f"{where}, whose part has no {name}; copy the whole bundle directory or "
                       "re-capture it")
    f = d / name   # NB: the caller checked that ``name`` is a plain file name
    head = read_header(f, f"bundle '{top.path}': {info['dir']}/{name}")
    top._cache[("head", str(f))] = head
    if verify:
        st = regular_file(f, f"bundle '{top.path}': {info['dir']}/{name}")
        if st.st_size != entry.get("bytes", st.st_size) or _sha256(f) != entry.get("sha256"):
            raise BadInput(f"bundle '{top.path}': {info['dir']}/{name} does not match its sha256 "
                           "in its part's manifest (truncated or altered); copy the bundle again "
                           "or re-capture it")
    names = [n for n in head if n != "__metadata__"]
    top._cache[key] = names
    return names
