"""The bundle on disk: a directory with ``manifest.json`` and ``.safetensors`` files.

Guarantees: a bundle is written into a hidden temporary directory beside its final path and renamed
into place only when every file and the manifest are on disk, so a crash never leaves a directory
that looks valid; its files get the permissions of the user's umask (0644 under umask 022), also
the tensor files, which safetensors itself writes 0600. Every file's sha256 is in the manifest and
checked on load. Reading a bundle parses JSON and safetensors only: it never unpickles and never
imports user code, and it is bounded in time and memory whatever the manifest or a safetensors
header claims (`read_bundle`, `read_header`: size, JSON values and depth, world size, tensor
count, offsets against the file's real size); a malformed manifest, header, field type, symbolic
link or part directory outside the bundle is a `BadInput` naming the file and the fix.
A part of a multi-rank bundle may take tensors from lower ranks' files (its manifest's
``shared``, see `_borrowed`); `Bundle.part` resolves them to the owner's file, verified by its
sha256, and refuses a reference to a rank, file or tensor that is not there, to a rank that is
not lower, to batch or RNG, or to any name that is not a plain tensor file of a part. Bundles
without ``shared`` read as before.
Not guaranteed: protection against a deliberately forged manifest whose checksums were recomputed
(such a bundle replays whatever tensors it holds; `inspect` stays safe); a file swapped between
the checks and the load (a bundle being rewritten while it is read); time to hash files that are
really as large as they are (a sparse 1 TB file is hashed, slowly).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import platform
import shutil
import stat
import struct
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nanbisect import __version__, devices
from nanbisect.errors import BadInput
from nanbisect.bundle.atomic import place
from nanbisect.bundle.state import Tensors

SCHEMA = "nanbisect.bundle/1"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
# Tensor files by role; a role with no tensors gets no file.
ROLES = ("model", "optimizer", "batch", "rng")
# Roles every rank of a multi-rank bundle writes itself, never taken from another rank's part
PER_RANK = ("batch", "rng")
SUFFIX = ".safetensors"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:   # Linux: read it without setting it
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)   # elsewhere: the only way to read it is to set it, and put it back
    os.umask(mask)
    return mask


def umask_mode(path: str | Path) -> None:
    """Give a file the permissions a new file gets under the user's umask (0644 under 022).

    safetensors >= 0.5 writes through a private temporary file, so its files are 0600 whatever the
    umask, which keeps a colleague from replaying a bundle; call this after every ``save_file``.
    """
    os.chmod(path, 0o666 & ~_umask())


def environment() -> dict:
    """Versions that decide whether a replay can be bit-exact, and the machine's hardware and
    library fingerprint (the device seam's `nanbisect.devices.fingerprint`)."""
    import numpy
    import safetensors

    return {"nanbisect": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "numpy": numpy.__version__, "safetensors": safetensors.__version__,
            "platform": platform.platform(), "torch_threads": torch.get_num_threads(),
            "hardware": devices.fingerprint()}


def write_bundle(path: Path, manifest: dict, tensors: dict[str, Tensors],
                 unique: bool = False) -> Path:
    """Write ``tensors`` (role -> flat tensor dict) and ``manifest`` atomically to ``path``.

    Every role with tensors gets ``ROLE.safetensors`` (the `ROLES` first, then any other role,
    e.g. a part's ``collectives``, by name); a role with none gets no file.

    >>> import tempfile
    >>> path = write_bundle(Path(tempfile.mkdtemp()) / "b", {"entry": "m:f"},
    ...                     {"batch": {"batch": torch.ones(2)}})
    >>> sorted(p.name for p in path.iterdir())
    ['batch.safetensors', 'manifest.json']
    """
    path = Path(path)
    if path.exists() and not unique:
        raise FileExistsError(f"{path} already exists; choose a new bundle path or remove it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files = {}
        for role in [*ROLES, *sorted(set(tensors) - set(ROLES))]:
            if not tensors.get(role):
                continue
            name = f"{role}{SUFFIX}"
            if not _safe_name(name):
                raise ValueError(f"tensor role {role!r} is not a plain file name")
            save_file(tensors[role], str(tmp / name))
            umask_mode(tmp / name)   # NB: safetensors >= 0.5 writes 0600 whatever the umask
            with open(tmp / name, "rb+") as f:
                os.fsync(f.fileno())
            files[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
        full = {"schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                "environment": environment(), **manifest, "files": files}
        _fsync_write(tmp / MANIFEST, json.dumps(full, indent=1, allow_nan=False).encode())
        # never over an existing path; with ``unique`` a taken name gets the next free NAME-N,
        # so two processes writing the same step both keep their bundle
        path = place(tmp, path, unique=unique)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# --------------------------------------------------------------------------------------------
# reading: bounded in time and memory whatever a manifest or a safetensors header claims

# A manifest costs ~540 bytes and ~23 JSON values per parameter tensor with Adam state, so these
# hold ~120,000 parameter tensors per rank (DeepSeek-V3 unsharded: ~46,000). A bigger real one:
# raise them with NANBISECT_MAX_MANIFEST_BYTES / NANBISECT_MAX_JSON_ITEMS.
MAX_MANIFEST_BYTES = 64 << 20
MAX_JSON_ITEMS = 4_000_000      # '{' + '[' + ',' in one manifest or header: bounds what parsing
#                                 builds (~0.3 GB, ~1 s at worst) before anything is parsed
MAX_JSON_DEPTH = 256            # a batch pytree nested ~80 levels deep still fits
MAX_WORLD_SIZE = 1 << 20
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
MAX_TENSORS = 1 << 19           # tensors in one .safetensors file
MAX_NDIM = 64
# safetensors dtype -> bits, the ones both its reader and torch know
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64,
              "U64": 64, "C64": 64}
_FIX = "copy the whole bundle again or re-capture it"


def _limit(env: str, default: int) -> int:
    """``default``, or the positive integer in environment variable ``env``."""
    value = os.environ.get(env)
    if not value:
        return default
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise BadInput(f"{env}={show(value)} is not a positive integer; set it to a number such "
                       f"as {default}, or unset it")
    return n


def show(value, limit: int = 60) -> str:
    """``value`` for a one-line message: repr (no newline or control character), cut short."""
    r = repr(value)
    if len(r) <= limit:
        return r
    return r[:limit - 4] + "..." + (r[0] if r[0] in "'\"" else "")


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _unique_keys(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {show(dup)}")
    return d


def _too_deep(obj, limit: int) -> bool:
    """Whether ``obj`` nests deeper than ``limit`` (level by level: no recursion, one list
    comprehension per container)."""
    level, depth = [obj], 1
    while level:
        if depth > limit:
            return True
        deeper: list = []
        for o in level:
            deeper += [v for v in (o.values() if type(o) is dict else o)
                       if type(v) is dict or type(v) is list]
        level, depth = deeper, depth + 1
    return False


def parse_json(raw: bytes, what: str, fix: str, unique_keys: bool = False):
    """Parse UTF-8 JSON within `MAX_JSON_ITEMS` and `MAX_JSON_DEPTH`; `BadInput` otherwise.

    >>> parse_json(b"[" * 300 + b"]" * 300, "x.json", "fix it")
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: x.json is nested deeper than 256 levels; fix it
    """
    items = raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    limit = _limit("NANBISECT_MAX_JSON_ITEMS", MAX_JSON_ITEMS)
    if items > limit:
        raise BadInput(f"{what} holds about {items} JSON values, more than the {limit} "
                       f"nanbisect reads; {fix} (a real one this big: raise "
                       "NANBISECT_MAX_JSON_ITEMS)")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys if unique_keys
                         else None)
    except RecursionError:
        obj = None
        deep = True
    except (ValueError, UnicodeDecodeError) as e:    # JSONDecodeError, duplicate key, 5000 digits
        raise BadInput(f"{what} is not valid JSON ({e.__class__.__name__}: "
                       f"{show(str(e), 80)[1:-1]}); {fix}") from None
    else:
        deep = isinstance(obj, (dict, list)) and _too_deep(obj, MAX_JSON_DEPTH)
    if deep:
        raise BadInput(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels; {fix}")
    return obj


def _regular(path: Path, shown: str, what: str = "file") -> os.stat_result:
    """lstat ``path``: a regular file (no symbolic link, device or pipe), else `BadInput`."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise BadInput(f"{shown} is missing or unreadable ({e.strerror}); {_FIX}") from None
    if stat.S_ISLNK(st.st_mode):
        raise BadInput(f"{shown} is a symbolic link; a bundle holds only plain files (links "
                       f"could read anything on this machine): {_FIX}")
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{shown} is not a plain {what}; {_FIX}")
    return st


def _uint(x, hi: int = 1 << 64) -> bool:
    return type(x) is int and 0 <= x < hi


def read_header(path: str | Path, shown: str | None = None) -> dict[str, dict]:
    """The JSON header of a safetensors file, checked as safetensors checks it (and stricter):
    name -> {dtype, shape, data_offsets}; `BadInput` naming ``shown`` (default: the path).

    Reads at most 8 bytes plus the header (never more than the file holds); loads no tensor data.
    """
    path = Path(path)
    shown = shown or str(path)

    def bad(why: str) -> BadInput:
        return BadInput(f"{shown} is not a readable safetensors file: {why}; {_FIX}")

    st = _regular(path, shown)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise bad(f"{st.st_size} bytes, shorter than a header")
            (n,) = struct.unpack("<Q", raw)
            if n > st.st_size - 8:
                raise bad(f"the header claims {n} bytes, the file has {st.st_size}")
            if n > MAX_HEADER_BYTES:
                raise bad(f"the header claims {n} bytes, more than safetensors reads")
            head_raw = f.read(n)
    except OSError as e:
        raise BadInput(f"{shown} cannot be read ({e.strerror}); {_FIX}") from None
    if len(head_raw) != n:
        raise bad("the file shrank while being read")
    if not head_raw.startswith(b"{"):
        raise bad("the header is not a JSON object")
    head = parse_json(head_raw, f"{shown}: the safetensors header", _FIX, unique_keys=True)
    if not isinstance(head, dict):
        raise bad("the header is not a JSON object")
    meta = head.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise bad("'__metadata__' is not an object of strings")
    if len(head) > MAX_TENSORS:
        raise bad(f"{len(head)} tensors, more than the {MAX_TENSORS} nanbisect reads")
    spans = []
    for name, t in head.items():
        if not isinstance(t, dict):
            raise bad(f"tensor {show(name)} is {_kind(t)}, not an object")
        dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise bad(f"tensor {show(name)} has unknown dtype {show(dtype, 30)}")
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(map(_uint, shape))):
            raise bad(f"tensor {show(name)} has shape {show(shape, 40)}, not a list of at most "
                      f"{MAX_NDIM} sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_uint, offsets))
                and offsets[0] <= offsets[1]):
            raise bad(f"tensor {show(name)} has data_offsets {show(offsets, 40)}, not "
                      "[begin, end] with 0 <= begin <= end")
        if math.prod(shape) * DTYPE_BITS[dtype] != (offsets[1] - offsets[0]) * 8:
            raise bad(f"tensor {show(name)}: shape {shape} of {dtype} needs "
                      f"{math.prod(shape) * DTYPE_BITS[dtype] // 8} bytes, its data_offsets span "
                      f"{offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise bad(f"tensor {show(name)} starts at byte {begin} of the data, not {end} "
                      "(tensors overlap or leave a gap)")
        end = stop
    if end != st.st_size - 8 - n:
        raise bad(f"the tensors cover {end} bytes of data, the file holds {st.st_size - 8 - n}")
    return head


def _load(path: Path, shown: str, names: list[str] | None = None) -> Tensors:
    """The tensors of one safetensors file (only ``names`` when given), header checked first."""
    read_header(path, shown)   # NB: ours first: sizes, offsets, no link
    try:
        if names is None:
            return load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            return {n: f.get_tensor(n) for n in names}
    except BaseException as e:   # SafetensorError, OSError, a torch error, a Rust panic
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise   # KeyboardInterrupt, SystemExit (pyo3's PanicException is a BaseException)
        raise BadInput(f"{shown} is not a readable safetensors file "
                       f"({show(str(e), 80)[1:-1]}); re-capture the bundle") from None


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
        out = (_load(self.path / name, f"bundle '{self.path}': {name}")
               if name in self.manifest["files"] else {})
        ref = (self.manifest.get("shared") or {}).get(name)
        if ref is None:
            return out
        if self.borrowed is None:
            n = ref.get("tensors") if isinstance(ref, dict) else None
            raise BadInput(f"bundle '{self.path}' is one rank's part of a multi-rank bundle and "
                           f"takes {n if _uint(n) else 'some'} tensors of {name} from a lower "
                           f"rank's part; open the whole bundle (nanbisect run --ckpt "
                           f"'{self.path.parent}'), not one part")
        for owner, names in self.borrowed.get(name, []):
            out.update(_load(owner / name, f"bundle '{owner.parent}': {owner.name}/{name}",
                             names))
        return out

    def all_tensors(self) -> Tensors:
        out: Tensors = {}
        for role in ROLES:
            out.update(self.tensors(role))
        return out

    @property
    def world_size(self) -> int:
        return int(self.manifest.get("world_size") or 1)

    @property
    def multi_rank(self) -> bool:
        return self.manifest.get("kind") == "multi-rank"

    def part(self, rank: int, verify: bool = True) -> "Bundle":
        """The verified part of one rank of a multi-rank bundle; the tensors it takes from lower
        ranks' parts are resolved and checked (the owner's file holds each one; with
        ``verify``, the owner's manifest and file match their sha256)."""
        info = self.manifest["ranks"][str(rank)]
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
        return replace(b, borrowed=_borrowed(self, rank, b, verify))


def _bundles_inside(p: Path, limit: int = 10_000) -> list[str]:
    """Names of the directories directly in ``p`` that hold a manifest.json, sorted (a Guard's
    ``out`` folder); at most ``limit`` entries are looked at."""
    names = []
    try:
        with os.scandir(p) as it:
            for i, e in enumerate(it):
                if i >= limit:
                    break
                if not e.name.startswith(".") and e.is_dir(follow_symlinks=False) and \
                        os.path.isfile(os.path.join(e.path, MANIFEST)):
                    names.append(e.name)
    except OSError:
        return []
    return sorted(names)


def _read_manifest(p: Path) -> dict:
    mpath = p / MANIFEST
    if not os.path.lexists(mpath):
        inside = _bundles_inside(p)
        if inside:
            shown = ", ".join(inside[:5]) + (f" and {len(inside) - 5} more"
                                             if len(inside) > 5 else "")
            raise BadInput(f"'{p}' is a folder of {len(inside)} bundle(s) ({shown}), not one "
                           f"bundle; pass one of them (e.g. '{p / inside[-1]}'), or replay them "
                           f"all with: nanbisect triage '{p}'")
        raise BadInput(f"bundle '{p}' has no manifest.json; it is not a nanbisect bundle or its "
                       "capture did not finish; re-capture it")
    st = _regular(mpath, f"bundle '{p}': manifest.json")
    limit = _limit("NANBISECT_MAX_MANIFEST_BYTES", MAX_MANIFEST_BYTES)
    if st.st_size > limit:
        raise BadInput(f"bundle '{p}': manifest.json has {st.st_size} bytes, more than the "
                       f"{limit} nanbisect reads; re-capture the bundle (a real one this big: "
                       "raise NANBISECT_MAX_MANIFEST_BYTES)")
    try:
        with open(mpath, "rb") as f:
            raw = f.read(st.st_size + 1)   # NB: not limit + 1: read(n) allocates n bytes
    except OSError as e:
        raise BadInput(f"bundle '{p}': manifest.json cannot be read ({e.strerror}); {_FIX}") \
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


def _int(v) -> bool:
    return type(v) is int   # NB: not bool


def _strs(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _str_map(v, values: type = str) -> bool:
    return isinstance(v, dict) and all(type(x) is values for x in v.values())


_NONE = type(None)
# field -> (check, what it must be); absent fields are fine unless `_REQUIRED`
_FIELDS = {
    "entry": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "files": (lambda v: isinstance(v, dict), "an object of file name -> {sha256, bytes}"),
    "model": (lambda v: isinstance(v, dict) and _strs(v.get("params")) and _strs(v.get("buffers"))
              and _str_map(v.get("aliases")) and _str_map(v.get("training", {}), bool)
              and _strs(v.get("frozen", [])),
              "an object with params and buffers (lists of names) and aliases (name -> name)"),
    "rng": (lambda v: isinstance(v, dict), "an object"),
    "optimizer": (lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("class"), str)
                                          and isinstance(v.get("state"), dict)
                                          and isinstance(v.get("param_groups"), list)),
                  "null or an object with class, state and param_groups"),
    "step": (lambda v: v is None or _int(v), "null or an integer"),
    "world_size": (lambda v: v is None or (_int(v) and 1 <= v <= MAX_WORLD_SIZE),
                   f"null or an integer from 1 to {MAX_WORLD_SIZE}"),
    "rank": (lambda v: v is None or (_int(v) and 0 <= v < MAX_WORLD_SIZE),
             "null or an integer >= 0"),
    "dtypes": (lambda v: v is None or _strs(v), "null or a list of strings"),
    "kind": (lambda v: v in (None, "multi-rank"), "absent or 'multi-rank'"),
    **{k: (lambda v: v is None or isinstance(v, dict), "null or an object")
       for k in ("observed", "devices", "environment", "grad_scaler", "task", "code")},
    **{k: (lambda v: v is None or isinstance(v, str), "null or a string")
       for k in ("entry_file", "entry_file_from_bundle", "created", "backend")},
    "process_groups": (lambda v: v is None or (isinstance(v, dict) and all(
        isinstance(r, list) and all(_int(x) for x in r) for r in v.values())),
        "null or an object of group name -> list of ranks"),
    "ranks": (lambda v: isinstance(v, dict), "an object of rank -> {dir, manifest_sha256}"),
    "shared": (lambda v: v is None or isinstance(v, dict),
               "null or an object of tensor file -> {rank, tensors} (tensors of lower ranks)"),
    "replicas": (lambda v: v is None or isinstance(v, dict), "null or an object"),
}
_REQUIRED = ("entry", "files", "model", "batch", "rng")
_REQUIRED_MULTI = ("entry", "world_size", "ranks")


def field_problem(key: str, value) -> str | None:
    """What ``value`` must be as the manifest's field ``key`` when it is not that, else None
    (sections that hold a copy of such a field, e.g. the lookback's model, are checked alike)."""
    ok, want = _FIELDS[key]
    return None if ok(value) else want


def _check_fields(p: Path, m: dict, required: tuple[str, ...]) -> None:
    for key in required:
        if key not in m:
            raise BadInput(f"bundle '{p}': manifest.json lacks '{key}'; re-capture the bundle")
    for key, (ok, want) in _FIELDS.items():
        if key in m and not ok(m[key]):
            raise BadInput(f"bundle '{p}': manifest.json field '{key}' is {_kind(m[key])}, not "
                           f"{want}; the manifest was altered or damaged: re-capture the bundle")


def _safe_name(name) -> bool:
    """A plain entry of the bundle directory: no path, no '.', '..', NUL or control character."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and name.isprintable() and len(name.encode("utf-8", "replace"))
            <= 255)


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
    if not p.exists():
        raise BadInput(f"bundle '{p}' does not exist; pass the directory written by "
                       "nanbisect.capture or Guard (it holds manifest.json)")
    if not p.is_dir():
        raise BadInput(f"bundle '{p}' is a file, not a directory; pass the bundle directory "
                       "that holds manifest.json")
    manifest = _read_manifest(p)
    if manifest.get("kind") == "multi-rank":
        if _part is not None:
            raise BadInput(f"bundle '{p}': the part of rank {_part} is itself a multi-rank bundle; "
                           "re-capture the bundle")
        return _read_multi(p, manifest, verify)
    _check_fields(p, manifest, _REQUIRED)
    if _part is not None and manifest.get("rank") not in (None, _part):
        raise BadInput(f"bundle '{p}': the part listed for rank {_part} says it is rank "
                       f"{manifest['rank']}; re-capture the bundle")
    for name, info in manifest["files"].items():
        if not _safe_name(name) or name == MANIFEST:
            raise BadInput(f"bundle '{p}': the manifest lists file {show(name)}, which is not a "
                           "plain file name in the bundle directory; re-capture the bundle")
        if not (isinstance(info, dict) and isinstance(info.get("sha256", ""), str)
                and _uint(info.get("bytes", 0))):
            raise BadInput(f"bundle '{p}': the manifest's entry for {show(name)} is "
                           f"{_kind(info)}, not {{sha256: string, bytes: integer}}; re-capture "
                           "the bundle")
    if verify:
        for name, info in manifest["files"].items():
            f = p / name
            if not os.path.lexists(f):
                raise BadInput(f"bundle '{p}': file '{name}' listed in the manifest is missing; "
                               "copy the whole bundle directory or re-capture it")
            st = _regular(f, f"bundle '{p}': {name}")
            if "bytes" in info and st.st_size != info["bytes"]:
                raise BadInput(f"bundle '{p}': {name} does not match its sha256 in the manifest "
                               f"({st.st_size} bytes, the manifest says {info['bytes']}: "
                               "truncated or altered); copy the bundle again or re-capture it")
            if _sha256(f) != info.get("sha256"):
                raise BadInput(f"bundle '{p}': {name} does not match its sha256 in the manifest "
                               "(truncated or altered); copy the bundle again or re-capture it")
    return Bundle(p, manifest)


def _read_multi(p: Path, manifest: dict, verify: bool) -> Bundle:
    """A multi-rank bundle: the top manifest names one verified part per rank."""
    _check_fields(p, manifest, _REQUIRED_MULTI)
    ranks, world = manifest["ranks"], manifest["world_size"]
    if world is None:
        raise BadInput(f"bundle '{p}': the top manifest's world_size is null, not an integer from "
                       f"1 to {MAX_WORLD_SIZE}; re-capture the bundle")
    # NB: compare counts first: nothing is built per claimed rank before the parts are counted
    if len(ranks) != world or set(ranks) != set(map(str, range(world))):
        raise BadInput(f"bundle '{p}': the top manifest lists {len(ranks)} parts, not one per "
                       f"rank 0..{world - 1} of its world size {world}; re-capture the bundle")
    dirs = []
    for r, info in ranks.items():
        d = info.get("dir") if type(info) is dict else None
        if type(d) is not str or (d != "rank" + r and not _safe_name(d)):
            raise BadInput(f"bundle '{p}': the top manifest's entry for rank {r} has no plain "
                           f"directory name in the bundle ('dir': {show(d)}); parts outside the "
                           "bundle are refused: re-capture the bundle")
        if type(info.get("manifest_sha256", "")) is not str:
            raise BadInput(f"bundle '{p}': the top manifest's manifest_sha256 of rank {r} is not a "
                           "string; re-capture the bundle")
        dirs.append(d)
    if len(set(dirs)) != len(dirs):
        seen: set = set()
        dup = next(d for d in dirs if d in seen or seen.add(d))
        raise BadInput(f"bundle '{p}': ranks share the part directory {show(dup)}; "
                       "re-capture the bundle")
    if verify:
        for r, info in ranks.items():
            d = p / info["dir"]
            if os.path.islink(d):
                raise BadInput(f"bundle '{p}': the part of rank {r} ({info['dir']}) is a symbolic "
                               "link; a bundle holds only plain directories: re-capture the bundle")
            if not (d / MANIFEST).is_file():
                raise BadInput(f"bundle '{p}': the part of rank {r} ({info['dir']}) is missing; "
                               "copy the whole bundle directory or re-capture it")
            _regular(d / MANIFEST, f"bundle '{p}': the manifest of rank {r}")
            if _sha256(d / MANIFEST) != info.get("manifest_sha256"):
                raise BadInput(f"bundle '{p}': the manifest of rank {r} does not match its "
                               "sha256 in the top manifest; re-capture the bundle")
            read_bundle(d, verify=True, _part=int(r))
    _check_replicas(p, manifest.get("replicas"))
    top = Bundle(p, manifest)
    if verify:   # every part's references to lower ranks' tensors resolve (files just verified)
        for r, info in ranks.items():
            part = read_bundle(p / info["dir"], verify=False, _part=int(r))
            if part.manifest.get("shared"):
                _borrowed(top, int(r), part, verify=False)
    return top


def _check_replicas(p: Path, v) -> None:
    """The top manifest's ``replicas`` has the shape `multirank.coord` writes (what inspect and
    the report read from it)."""
    if v is None:
        return

    def ranks_list(x) -> bool:
        return isinstance(x, list) and all(_int(y) for y in x)

    rows = v.get("out_of_sync", [])
    ok = (isinstance(v.get("groups", []), list) and all(map(ranks_list, v.get("groups", [])))
          and _uint(v.get("shared_bytes", 0)) and _uint(v.get("shared_tensors", 0))
          and _uint(v.get("out_of_sync_count", 0)) and ranks_list(v.get("uncompared", []))
          and isinstance(rows, list) and all(
              isinstance(e, dict) and isinstance(e.get("tensor"), str)
              and isinstance(e.get("ranks"), list) and all(map(ranks_list, e["ranks"]))
              and ranks_list(e.get("missing", []))
              and (e.get("max_abs_diff") is None
                   or type(e.get("max_abs_diff")) in (int, float, str)) for e in rows))
    if not ok:
        raise BadInput(f"bundle '{p}': the top manifest's 'replicas' is not {{groups, "
                       "shared_bytes, out_of_sync: [{tensor, ranks, max_abs_diff}]}; the "
                       "manifest was altered or damaged: re-capture the bundle")


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
    fix = "the manifest was altered or damaged: re-capture the bundle"
    world, ranks = top.world_size, top.manifest["ranks"]
    out: dict[str, list] = {}
    for name, ref in part.manifest["shared"].items():
        if not (_safe_name(name) and name.endswith(SUFFIX)) or name == MANIFEST:
            raise BadInput(f"{shown} takes tensors of {show(name)} from another rank's part, "
                           "which is not a tensor file name of a part (parts outside the bundle "
                           f"are refused); {fix}")
        if name[:-len(SUFFIX)] in PER_RANK:
            raise BadInput(f"{shown} takes {name} from another rank's part, but every rank "
                           f"writes its batch and RNG itself; {fix}")
        frm = ref.get("from", {}) if isinstance(ref, dict) else None
        if not (isinstance(ref, dict) and _int(ref.get("rank")) and _uint(ref.get("tensors"))
                and isinstance(frm, dict) and all(_strs(v) for v in frm.values())
                and all(isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 10
                        for k in frm) and _strs(ref.get("skip", []))):
            raise BadInput(f"{shown}: its 'shared' entry for {name} is not {{rank: integer, "
                           "tensors: integer, from: {rank: [names]}, skip: [names]}; " + fix)
        own_head = (read_header(part.path / name, f"bundle '{part.path}': {name}")
                    if name in part.manifest["files"] else {})
        own = set(own_head) - {"__metadata__"}
        default = ref["rank"]
        taken: list[tuple[int, list[str]]] = [(int(k), v) for k, v in frm.items()]
        named: set = set()
        for n in (n for _, v in taken for n in v):
            if n in own or n in named:
                raise BadInput(f"{shown} has tensor {show(n)} of {name} twice (in its own file "
                               f"and another rank's, or in two ranks'); {fix}")
            named.add(n)
        for owner in [default, *(o for o, _ in taken)]:
            if not 0 <= owner < world:
                raise BadInput(f"{shown} takes tensors of {name} from rank {owner}, which is not "
                               f"a rank of this bundle (world size {world}); {fix}")
            if owner >= rank:
                raise BadInput(f"{shown} takes tensors of {name} from rank {owner}, not a lower "
                               f"rank (the lowest rank holding them writes them); {fix}")
        heads = {o: _owner_names(top, o, name, shown, verify) for o in {default, *dict(taken)}}
        for o, names in taken:
            missing = next((n for n in names if n not in heads[o]), None)
            if missing is not None:
                raise BadInput(f"{shown} takes tensor {show(missing)} of {name} from rank {o}, "
                               f"whose {name} does not hold it; {fix}")
        skip = set(ref.get("skip", []))
        rest = [n for n in heads[default] if n not in own and n not in named and n not in skip]
        if len(rest) + len(named) != ref["tensors"]:
            raise BadInput(f"{shown} takes {ref['tensors']} tensors of {name} from lower ranks, "
                           f"but their files provide {len(rest) + len(named)}; {fix}")
        dirs = {o: top.path / ranks[str(o)]["dir"] for o in heads}
        out[name] = [(dirs[default], rest)] * bool(rest) + [(dirs[o], v) for o, v in taken if v]
    return out


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
        _check_fields(d, m, _REQUIRED)
        top._cache[("manifest", owner)] = m
    entry = m["files"].get(name)
    if not isinstance(entry, dict):
        raise BadInput(f"{where}, whose part has no {name}; copy the whole bundle directory or "
                       "re-capture it")
    f = d / name   # NB: the caller checked that ``name`` is a plain file name
    head = read_header(f, f"bundle '{top.path}': {info['dir']}/{name}")
    if verify:
        st = _regular(f, f"bundle '{top.path}': {info['dir']}/{name}")
        if st.st_size != entry.get("bytes", st.st_size) or _sha256(f) != entry.get("sha256"):
            raise BadInput(f"bundle '{top.path}': {info['dir']}/{name} does not match its sha256 "
                           "in its part's manifest (truncated or altered); copy the bundle again "
                           "or re-capture it")
    names = [n for n in head if n != "__metadata__"]
    top._cache[key] = names
    return names
