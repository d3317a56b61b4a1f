"""Reading files nobody vouches for: JSON and safetensors headers, bounded in time and memory
whatever they claim (size, JSON values and depth, tensor count, offsets against the file's real
size); what is out of bounds or malformed is `BadInput` naming the file and the fix.
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file

from nanbisect.bundle.lazy import LazyTensors
from nanbisect.bundle.state import Tensors
from nanbisect.errors import BadInput
from nanbisect.util.numbers import env
from nanbisect.util.text import show


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
# the fix named by a refusal of a file that is missing, a link or damaged
RECOPY_FIX = "copy the whole bundle again or re-capture it"


def _limit(name: str, default: int) -> int:
    """``default``, or the positive integer in environment variable ``name``."""
    return env(name, default)


def kind_of(value) -> str:
    """What a JSON value is, for a message: ``kind_of([])`` is ``'a list'``."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value),
                                                                       type(value).__name__)


def _unique_keys(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {show(dup)}")
    return d


def too_deep(obj, limit: int) -> bool:
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


class _NonFinite(Exception):
    """``NaN``, ``Infinity`` or ``-Infinity`` in JSON text (Python's json reads them; the JSON
    standard and every nanbisect writer do not)."""


def _no_constant(name: str):
    raise _NonFinite(name)


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):   # 1e999: a JSON number that no float holds
        raise _NonFinite(show(text, 40)[1:-1])
    return x


def parse_json(raw: bytes, what: str, fix: str, unique_keys: bool = False):
    """Parse UTF-8 JSON within `MAX_JSON_ITEMS` and `MAX_JSON_DEPTH`; `BadInput` otherwise,
    also for ``NaN``/``Infinity`` (not JSON numbers: no reader downstream ever meets one).

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
                         else None, parse_constant=_no_constant, parse_float=_finite)
    except _NonFinite as e:
        raise BadInput(f"{what} holds {e}, which is not a finite JSON number (nanbisect writes a "
                       f"non-finite value as a string, e.g. \"nan\"); {fix}") from None
    except RecursionError:
        obj = None
        deep = True
    except (ValueError, UnicodeDecodeError) as e:    # JSONDecodeError, duplicate key, 5000 digits
        raise BadInput(f"{what} is not valid JSON ({e.__class__.__name__}: "
                       f"{show(str(e), 80)[1:-1]}); {fix}") from None
    else:
        deep = isinstance(obj, (dict, list)) and too_deep(obj, MAX_JSON_DEPTH)
    if deep:
        raise BadInput(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels; {fix}")
    return obj


def regular_file(path: Path, shown: str, what: str = "file") -> os.stat_result:
    """lstat ``path``: a regular file (no symbolic link, device or pipe), else `BadInput`."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise BadInput(f"{shown} is missing or unreadable ({e.strerror}); {RECOPY_FIX}") from None
    if stat.S_ISLNK(st.st_mode):
        raise BadInput(f"{shown} is a symbolic link; a bundle holds only plain files (links "
                       f"could read anything on this machine): {RECOPY_FIX}")
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{shown} is not a plain {what}; {RECOPY_FIX}")
    return st


def is_uint(x, hi: int = 1 << 64) -> bool:
    """Whether ``x`` is an int (not a bool) in [0, ``hi``): a size or an offset."""
    return type(x) is int and 0 <= x < hi


def read_header(path: str | Path, shown: str | None = None) -> dict[str, dict]:
    """The JSON header of a safetensors file, checked as safetensors checks it (and stricter):
    name -> {dtype, shape, data_offsets}; `BadInput` naming ``shown`` (default: the path).

    Reads at most 8 bytes plus the header (never more than the file holds); loads no tensor data.
    """
    path = Path(path)
    shown = shown or str(path)

    def bad(why: str) -> BadInput:
        return BadInput(f"{shown} is not a readable safetensors file: {why}; {RECOPY_FIX}")

    st = regular_file(path, shown)
    n, head_raw = _header_bytes(path, shown, st.st_size, bad)
    if not head_raw.startswith(b"{"):
        raise bad("the header is not a JSON object")
    head = parse_json(head_raw, f"{shown}: the safetensors header", RECOPY_FIX, unique_keys=True)
    if not isinstance(head, dict):
        raise bad("the header is not a JSON object")
    meta = head.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise bad("'__metadata__' is not an object of strings")
    if len(head) > MAX_TENSORS:
        raise bad(f"{len(head)} tensors, more than the {MAX_TENSORS} nanbisect reads")
    spans = [_span(name, t, bad) for name, t in head.items()]
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise bad(f"tensor {show(name)} starts at byte {begin} of the data, not {end} "
                      "(tensors overlap or leave a gap)")
        end = stop
    if end != st.st_size - 8 - n:
        raise bad(f"the tensors cover {end} bytes of data, the file holds {st.st_size - 8 - n}")
    return head


def _header_bytes(path: Path, shown: str, size: int, bad) -> tuple[int, bytes]:
    """(the header's length, its bytes) from a file of ``size`` bytes: its 8-byte length read
    first and checked against the file and `MAX_HEADER_BYTES`."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise bad(f"{size} bytes, shorter than a header")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise bad(f"the header claims {n} bytes, the file has {size}")
            if n > MAX_HEADER_BYTES:
                raise bad(f"the header claims {n} bytes, more than safetensors reads")
            head_raw = f.read(n)
    except OSError as e:
        raise BadInput(f"{shown} cannot be read ({e.strerror}); {RECOPY_FIX}") from None
    if len(head_raw) != n:
        raise bad("the file shrank while being read")
    return n, head_raw


def _span(name: str, t, bad) -> tuple[int, int, str]:
    """(begin, end, name) of one tensor's entry in a header, its dtype, shape and data offsets
    checked (`bad(why)`: the error to raise)."""
    if not isinstance(t, dict):
        raise bad(f"tensor {show(name)} is {kind_of(t)}, not an object")
    dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise bad(f"tensor {show(name)} has unknown dtype {show(dtype, 30)}")
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(map(is_uint, shape))):
        raise bad(f"tensor {show(name)} has shape {show(shape, 40)}, not a list of at most "
                  f"{MAX_NDIM} sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_uint, offsets))
            and offsets[0] <= offsets[1]):
        raise bad(f"tensor {show(name)} has data_offsets {show(offsets, 40)}, not "
                  "[begin, end] with 0 <= begin <= end")
    if math.prod(shape) * DTYPE_BITS[dtype] != (offsets[1] - offsets[0]) * 8:
        raise bad(f"tensor {show(name)}: shape {shape} of {dtype} needs "
                  f"{math.prod(shape) * DTYPE_BITS[dtype] // 8} bytes, its data_offsets span "
                  f"{offsets[1] - offsets[0]}")
    return offsets[0], offsets[1], name


def add_lazy(lazy: "LazyTensors", path: Path, shown: str, names: list[str] | None = None
             ) -> None:
    """Serve ``path``'s tensors (only ``names`` when given) from ``lazy``, read when asked
    (`nanbisect.bundle.lazy`); the header checked here, as `load_tensors` checks it."""
    head = read_header(path, shown)
    n = struct.unpack("<Q", _first_bytes(path, shown))[0]
    if names is not None and not set(names) <= set(head):
        missing = sorted(set(names) - set(head))[:3]
        raise BadInput(f"{shown} lacks tensor(s) {missing}; {RECOPY_FIX}")
    lazy.add_file(path, shown, head, 8 + n, names)


def _first_bytes(path: Path, shown: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(8)
    except OSError as e:
        raise BadInput(f"{shown} cannot be read ({e.strerror}); {RECOPY_FIX}") from None


def load_tensors(path: Path, shown: str, names: list[str] | None = None, checked: bool = False
          ) -> Tensors:
    """The tensors of one safetensors file (only ``names`` when given), header checked first
    (``checked``: `read_bundle` just checked it)."""
    if not checked:
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
