"""The manifest's schema: the bundle's fixed names and the type every field must have, checked
before anything trusts a manifest nanbisect did not write.

Guarantees: every check is pure and bounded by the size of the value it is given; a field of the
wrong type is `BadInput` naming the bundle, the field and what it must be.
"""
from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

import torch

from nanbisect.bundle.where import MANIFEST  # noqa: F401 - re-exported
from nanbisect.bundle.bounded import MAX_WORLD_SIZE, is_uint, kind_of, too_deep
from nanbisect.errors import BadInput
from nanbisect.task import split_entry
from nanbisect.util import fingerprint
from nanbisect.util.compiled import MAX_DROPPED, MAX_NAME, option_problem
from nanbisect.util.text import show

SCHEMA = "nanbisect.bundle/1"
SCHEMA_VERSION = 1
# Tensor files by role; a role with no tensors gets no file.
ROLES = ("model", "optimizer", "batch", "rng")
# Roles every rank of a multi-rank bundle writes itself, never taken from another rank's part
PER_RANK = ("batch", "rng")
# Roles a replay reads from their files when it restores, never holding them (the state)
LAZY_ROLES = ("model", "optimizer")
SUFFIX = ".safetensors"


def is_int(v) -> bool:
    """Whether ``v`` is a JSON integer (``True`` is not)."""
    return type(v) is int   # NB: not bool


def is_strs(v) -> bool:
    """Whether ``v`` is a list of strings."""
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _str_map(v, values: type = str) -> bool:
    return isinstance(v, dict) and all(type(x) is values for x in v.values())


_NONE = type(None)
# field -> (check, what it must be); absent fields are fine unless `REQUIRED`
_FIELDS = {
    "entry": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "files": (lambda v: isinstance(v, dict), "an object of file name -> {sha256, bytes}"),
    "model": (lambda v: isinstance(v, dict) and is_strs(v.get("params"))
              and is_strs(v.get("buffers")) and _str_map(v.get("aliases"))
              and _str_map(v.get("training", {}), bool)
              and is_strs(v.get("frozen", [])),
              "an object with params and buffers (lists of names) and aliases (name -> name)"),
    "rng": (lambda v: isinstance(v, dict), "an object"),
    "optimizer": (lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("class"), str)
                                          and isinstance(v.get("state"), dict)
                                          and isinstance(v.get("param_groups"), list)),
                  "null or an object with class, state and param_groups"),
    "step": (lambda v: v is None or is_int(v), "null or an integer"),
    "world_size": (lambda v: v is None or (is_int(v) and 1 <= v <= MAX_WORLD_SIZE),
                   f"null or an integer from 1 to {MAX_WORLD_SIZE}"),
    "rank": (lambda v: v is None or (is_int(v) and 0 <= v < MAX_WORLD_SIZE),
             "null or an integer >= 0"),
    "dtypes": (lambda v: v is None or is_strs(v), "null or a list of strings"),
    "kind": (lambda v: v in (None, "multi-rank"), "absent or 'multi-rank'"),
    **{k: (lambda v: v is None or isinstance(v, dict), "null or an object")
       for k in ("observed", "devices", "environment", "grad_scaler", "task", "code")},
    **{k: (lambda v: v is None or isinstance(v, str), "null or a string")
       for k in ("entry_file", "entry_file_from_bundle", "created", "backend")},
    "process_groups": (lambda v: v is None or (isinstance(v, dict) and all(
        isinstance(r, list) and all(is_int(x) for x in r) for r in v.values())),
        "null or an object of group name -> list of ranks"),
    "ranks": (lambda v: isinstance(v, dict), "an object of rank -> {dir, manifest_sha256}"),
    "shared": (lambda v: v is None or isinstance(v, dict),
               "null or an object of tensor file -> {rank, tensors} (tensors of lower ranks)"),
    "replicas": (lambda v: v is None or isinstance(v, dict), "null or an object"),
    "partial": (lambda v: v is None or isinstance(v, dict) or _parts_missing(v),
                "null, an object {missing_ranks: [ranks], reasons: {rank: text}} (a multi-rank "
                "bundle's top manifest) or a list of {part, why} (the parts of the state "
                "that could not be written)"),
}
MAX_PARTS_MISSING = 64      # entries of a manifest's list of parts left out


def _parts_missing(v) -> bool:
    """``partial`` as the list a writer makes when part of the state could not be written:
    [{"part": name, "why": text}, ...]."""
    return isinstance(v, list) and len(v) <= MAX_PARTS_MISSING and all(
        isinstance(e, dict) and set(e) == {"part", "why"} and isinstance(e["part"], str)
        and len(e["part"]) <= 64 and isinstance(e["why"], str) and len(e["why"]) <= 4096
        for e in v)


def parts_missing(manifest: dict) -> list[dict]:
    """The parts of the state a (checked) manifest says were left out, [{part, why}]; [] for a
    complete one (and for a multi-rank top manifest's ``partial``, which names ranks).

    >>> parts_missing({"partial": [{"part": "optimizer", "why": "KeyError: 'state'"}]})[0]["part"]
    'optimizer'
    >>> parts_missing({"partial": {"missing_ranks": [1]}}), parts_missing({})
    ([], [])
    """
    v = manifest.get("partial")
    return list(v) if isinstance(v, list) else []


# the fields a manifest must have: a bundle's (or a part's), a multi-rank bundle's top one
REQUIRED = ("entry", "files", "model", "batch", "rng")
REQUIRED_MULTI = ("entry", "world_size", "ranks")


# --------------------------------------------------------------------------------------------
# the sections: what every key a writer puts in them must be (a key a newer nanbisect adds is
# let through; a known key of another type is not). NB: parse_json let no NaN or Infinity in.

MAX_SECTION_DEPTH = 8     # levels below a section (the deepest the Guard writes: 3)
MAX_THREADS = 1 << 16
MAX_ACCUMULATE = 1 << 20
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?")


def _num(v) -> bool:
    return type(v) in (int, float)


def _path(v) -> bool:
    """A path nanbisect may hand to the file system: no NUL (Path.is_file raises on one)."""
    return isinstance(v, str) and v != "" and "\x00" not in v and len(v) <= 4096


def _count(v) -> bool:
    return type(v) is int and 0 <= v < 1 << 63


def _device(v) -> bool:
    return isinstance(v, str) and _DEVICE.fullmatch(v) is not None


def _dtype_name(v) -> bool:
    return isinstance(v, str) and v.isidentifier() and isinstance(getattr(torch, v, None),
                                                                   torch.dtype)


def _names(v) -> bool:
    """nonfinite_grads / nonfinite_params as the Guard writes them."""
    return isinstance(v, dict) and all(is_strs(x) if k in ("nan", "inf") else _count(x)
                                       for k, x in v.items())


def _parts(v) -> bool:
    """``task.parts``: what the captured Task's code was (`nanbisect.util.fingerprint`)."""
    return isinstance(v, dict) and len(v) <= 8 and all(
        k in fingerprint.PARTS and isinstance(d, dict)
        and set(d) <= {"name", "code", "python"}
        and all(isinstance(x, str) and len(x) <= 400 for x in d.values())
        for k, d in v.items())


def _compiled(v) -> bool:
    """``task.compiled``: null, or {backend, mode, options} where nothing names a program or a
    path: the backend a registered name, the mode one of torch.compile's, the options an object
    of fewer than 64 (each checked by `check_compiled_options`: a bundle is data, its options must
    not choose the C++ compiler a replay runs, nor what it writes or where)."""
    if v is None:
        return True
    if not isinstance(v, dict) or set(v) - {"backend", "mode", "options"}:
        return False
    backend, mode, options = v.get("backend"), v.get("mode"), v.get("options")
    return (isinstance(backend, str) and backend.replace("_", "").isalnum() and len(backend) < 64
            and (mode is None or mode in ("default", "reduce-overhead", "max-autotune",
                                          "max-autotune-no-cudagraphs"))
            and (options is None or (isinstance(options, dict) and len(options) < 64)))


def check_compiled_options(p: Path, field: str, compiled) -> None:
    """`BadInput` naming the first option of ``compiled`` (a ``task.compiled`` that passed
    `_compiled`) that is not one a replay applies with a value it may take
    (`nanbisect.util.compiled.REPLAYED`): one line, the name and value cut short."""
    options = compiled.get("options") if isinstance(compiled, dict) else None
    for name, value in (options or {}).items():
        problem = option_problem(name, value)
        if problem is not None:
            raise BadInput(f"bundle '{p}': manifest.json field '{field}.options' holds the "
                           f"inductor option {show(name, 60)}, which {problem} (docs/guide/"
                           "compiled.md lists those it replays); the manifest was "
                           "altered or written by an older nanbisect: re-capture the bundle")


def _dropped(v) -> bool:
    """``task.compiled_dropped``: the names of the options the capture compiled with and did not
    record (`nanbisect.util.compiled.recorded`)."""
    return is_strs(v) and len(v) <= MAX_DROPPED and all(len(x) <= MAX_NAME for x in v)


REBUILD_FIDELITY = ("bit-exact", "within-tolerance", "mismatch", "unavailable")


def _rebuild(v) -> bool:
    """``observed.rebuild``: how a Guard rebuilt the pre-state of a step whose update failed
    (`nanbisect.guard.keep.Rebuilt`)."""
    return isinstance(v, dict) and set(v) - {"why"} == {"from_step", "steps", "fidelity",
                                                      "max_rel_diff", "first_mismatch"} \
        and (not isinstance(v.get("why"), str) or len(v["why"]) <= 1000) \
        and ("why" not in v or isinstance(v["why"], str)) \
        and (v["from_step"] is None or _count(v["from_step"])) and _count(v["steps"]) \
        and v["fidelity"] in REBUILD_FIDELITY \
        and (v["max_rel_diff"] is None or _num(v["max_rel_diff"])) \
        and (v["first_mismatch"] is None or _count(v["first_mismatch"]))


_LOSS = (lambda v: v is None or _num(v) or isinstance(v, str),
         "null, a number or a string such as 'nan'")
_SECTIONS: dict[str, dict[str, tuple]] = {
    "devices": {
        "captured_on": (_device, "a device such as 'cpu' or 'cuda:0'"),
        "accelerators": (lambda v: isinstance(v, list) and all(map(_device, v)),
                         "a list of device types")},
    "observed": {
        "step": (lambda v: v is None or is_int(v), "null or an integer"),
        "first": (lambda v: v is None or isinstance(v, str), "null or a string"),
        "loss": _LOSS, "grad_norm": _LOSS,
        "summary": (_str_map, "an object of strings"),
        "nonfinite_grads": (_names, "{nan: [names], inf: [names], nan_count, inf_count}"),
        "nonfinite_params": (_names, "{nan: [names], inf: [names], nan_count, inf_count}"),
        "scaler_skips": (_count, "an integer >= 0"),
        "undeclared_scaler": (lambda v: isinstance(v, bool), "true or false"),
        "rank": (lambda v: is_int(v) and 0 <= v < MAX_WORLD_SIZE, "an integer >= 0"),
        "spike": (lambda v: isinstance(v, dict) and all(map(_num, v.values())),
                  "an object of numbers"),
        "rebuild": (_rebuild, "{from_step: null or an integer >= 0, steps: an integer >= 0, "
                    "fidelity: one of " + ", ".join(REBUILD_FIDELITY) + ", max_rel_diff: null "
                    "or a number, first_mismatch: null or an integer, why: a string}")},
    "task": {
        "accumulate": (lambda v: is_int(v) and 1 <= v <= MAX_ACCUMULATE,
                       f"an integer from 1 to {MAX_ACCUMULATE}"),
        "clip_grad_norm": (lambda v: v is None or (_num(v) and v > 0), "null or a number > 0"),
        "grad_scaler": (lambda v: isinstance(v, bool), "true or false"),
        "loss_normalized": (lambda v: isinstance(v, bool), "true or false"),
        "autocast": (lambda v: v is None or _dtype_name(v), "null or a torch dtype name"),
        "compiled": (_compiled, "null or {backend: a backend name, mode: null or a "
                     "torch.compile mode, options: null or {option: value}}"),
        "compiled_dropped": (_dropped, f"a list of at most {MAX_DROPPED} option names"),
        "run_top_level": (lambda v: isinstance(v, bool), "true or false"),
        "parts": (_parts, "an object of model/loss_fn/step_fn/optimizer -> {name: a string, "
                  "code: a hex string, python: a version string}")},
    "grad_scaler": {   # torch's GradScaler.state_dict(): all five, or {} (a disabled scaler)
        "scale": (lambda v: _num(v) and v >= 0, "a number >= 0"),
        "growth_factor": (_num, "a number"), "backoff_factor": (_num, "a number"),
        "growth_interval": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
        "_growth_tracker": (lambda v: is_int(v) and v >= 0, "an integer >= 0")},
    "code": {
        "entry_file": (lambda v: v is None or _path(v), "null or a path"),
        "sources": (lambda v: isinstance(v, dict) and all(map(_path, v))
                    and _str_map(v), "an object of path -> sha256"),
        # the stored copies (`nanbisect.bundle.codestore`; each file's path checked there)
        "root": (lambda v: v is None or _path(v), "null or a path"),
        "files": (lambda v: isinstance(v, dict) and all(map(_path, v)) and all(
            isinstance(x, dict) for x in v.values()),
            "an object of path -> {path: 'code/...', sha256, bytes}"),
        "left_out": (lambda v: isinstance(v, dict) and all(map(_path, v)) and _str_map(v),
                     "an object of path -> reason"),
        "import_roots": (is_strs, "a list of directories under code/"),
        "caps": (lambda v: isinstance(v, dict) and all(map(_count, v.values())),
                 "an object of integers")},
    "environment": {
        **{k: (lambda v: isinstance(v, str), "a string")
           for k in ("nanbisect", "torch", "python", "numpy", "safetensors", "platform")},
        "torch_threads": (lambda v: is_int(v) and 1 <= v <= MAX_THREADS,
                          f"an integer from 1 to {MAX_THREADS}"),
        "hardware": (lambda v: isinstance(v, dict), "an object")},
}


def _bad(p: Path, field: str, value, want: str) -> BadInput:
    return BadInput(f"bundle '{p}': manifest.json field '{field}' is {kind_of(value)}, not "
                    f"{want}; the manifest was altered or damaged: re-capture the bundle")


_SCALER_KEYS = "{} or {scale, growth_factor, backoff_factor, growth_interval, _growth_tracker}"


def _section_problem(name: str, v: dict) -> tuple[str | None, str] | None:
    """The first problem of ``v`` as section ``name``: (its key, or None for the section
    itself; what it must be), or None."""
    spec = _SECTIONS[name]
    if name == "grad_scaler" and v and not set(spec) <= set(v):   # what load_state_dict reads
        return None, _SCALER_KEYS
    for key, (ok, want) in spec.items():
        if key in v and not ok(v[key]):
            return key, want
    if too_deep(v, MAX_SECTION_DEPTH):
        return None, f"nested at most {MAX_SECTION_DEPTH} levels deep"
    return None


def check_section(p: Path, name: str, v, field: str | None = None) -> None:
    """`BadInput` unless ``v`` is null or the section ``name`` as its writer writes it (shown as
    manifest field ``field``, default ``name``)."""
    field = field or name
    if v is None:
        return
    if not isinstance(v, dict):
        raise _bad(p, field, v, "null or an object")
    problem = _section_problem(name, v)
    if problem is None:
        if name == "task":
            check_compiled_options(p, f"{field}.compiled", v.get("compiled"))
        return
    key, want = problem
    if key is not None:
        raise _bad(p, f"{field}.{key}", v[key], want)
    if want == _SCALER_KEYS:
        raise _bad(p, field, v, want)
    raise BadInput(f"bundle '{p}': manifest.json field '{field}' is nested deeper than "
                   f"{MAX_SECTION_DEPTH} levels; the manifest was altered or damaged: "
                   "re-capture the bundle")


def check_sections(p: Path, m: dict) -> None:
    """Every known key of the manifest's sections (`_SECTIONS`) of the type its writer gives it,
    each section at most `MAX_SECTION_DEPTH` levels deep, and the entry and its files usable as
    an entry string and paths; `BadInput` naming the first field that is not. Pure and bounded
    by the manifest's size (its depth was bounded when it was parsed)."""
    for name in _SECTIONS:
        check_section(p, name, m.get(name))
    if "entry" in m:
        try:
            split_entry(m["entry"])
            ok = _path(m["entry"])
        except BadInput:
            ok = False
        if not ok:
            raise BadInput(f"bundle '{p}': manifest.json field 'entry' {show(m['entry'], 60)} "
                           "is not of the form 'pkg.module:function' or "
                           "'path/to/file.py:function'; replay it with --entry ENTRY, or "
                           "re-capture the bundle")
    if m.get("entry_file") is not None and not _path(m["entry_file"]):
        raise _bad(p, "entry_file", m["entry_file"], "null or a path")
    rel = m.get("entry_file_from_bundle")
    if rel is not None and not (_path(rel) and rel.endswith(".py")
                                and not PurePosixPath(rel).is_absolute()):
        raise _bad(p, "entry_file_from_bundle", rel,
                   "null or a path to a .py file relative to the bundle")


def field_problem(key: str, value) -> str | None:
    """What ``value`` must be as the manifest's field ``key`` when it is not that, else None
    (sections that hold a copy of such a field, e.g. the lookback's model, are checked alike)."""
    ok, want = _FIELDS[key]
    if not ok(value):
        return want
    problem = _section_problem(key, value) if key in _SECTIONS and isinstance(value, dict) \
        else None
    if problem is None:
        return None
    k, want = problem
    return want if k is None else f"an object whose '{k}' is {want}"


def check_fields(p: Path, m: dict, required: tuple[str, ...]) -> None:
    """`BadInput` naming the first field of manifest ``m`` (of bundle ``p``) that is missing
    (of ``required``) or not of its type (`_FIELDS`), then `check_sections`."""
    for key in required:
        if key not in m:
            raise BadInput(f"bundle '{p}': manifest.json lacks '{key}'; re-capture the bundle")
    for key, (ok, want) in _FIELDS.items():
        if key in m and not ok(m[key]):
            raise _bad(p, key, m[key], want)
    check_sections(p, m)


def safe_name(name) -> bool:
    """A plain entry of the bundle directory: no path, no '.', '..', NUL or control character."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and name.isprintable() and len(name.encode("utf-8", "replace"))
            <= 255)


def check_replicas(p: Path, v) -> None:
    """The top manifest's ``replicas`` has the shape `guard.coord` writes (what inspect and
    the report read from it)."""
    if v is None:
        return

    def ranks_list(x) -> bool:
        return isinstance(x, list) and all(is_int(y) for y in x)

    rows = v.get("out_of_sync", [])
    ok = (isinstance(v.get("groups", []), list) and all(map(ranks_list, v.get("groups", [])))
          and is_uint(v.get("shared_bytes", 0)) and is_uint(v.get("shared_tensors", 0))
          and is_uint(v.get("out_of_sync_count", 0)) and ranks_list(v.get("uncompared", []))
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


MAX_REASON = 4096   # characters of one missing rank's reason in ``partial``


def check_partial(p: Path, v, world: int, listed) -> list[int]:
    """The ranks a partial multi-rank bundle lacks (its top manifest's ``partial``, as
    `nanbisect.guard.parts` writes it: ``{"missing_ranks": [r, ...] (increasing), "reasons":
    {"r": text}}``); [] for a complete one. The ranks listed (``listed``: the ``ranks`` keys)
    and the missing ones together are every rank 0..world-1, each once: anything else is
    `BadInput`. Bounded by the size of the lists given (nothing is built per claimed rank)."""
    if v is None:
        return []
    fix = "the manifest was altered or damaged: re-capture the bundle"
    missing, reasons = v.get("missing_ranks"), v.get("reasons", {})
    if not (isinstance(missing, list) and missing and all(is_int(r) for r in missing)
            and all(a < b for a, b in zip(missing, missing[1:]))
            and 0 <= missing[0] and missing[-1] < world):
        raise BadInput(f"bundle '{p}': the top manifest's 'partial' has missing_ranks "
                       f"{kind_of(missing)}, not a non-empty increasing list of ranks from 0 to "
                       f"{world - 1}; {fix}")
    if not (isinstance(reasons, dict) and all(
            isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 10
            and isinstance(t, str) and len(t) <= MAX_REASON for k, t in reasons.items())
            and {int(k) for k in reasons} <= set(missing)):
        raise BadInput(f"bundle '{p}': the top manifest's 'partial' has reasons "
                       f"{kind_of(reasons)}, not an object of missing rank -> text (at most "
                       f"{MAX_REASON} characters); {fix}")
    if len(listed) + len(missing) != world or any(str(r) in listed for r in missing):
        raise BadInput(f"bundle '{p}': the top manifest lists {len(listed)} parts and "
                       f"{len(missing)} missing ranks, not each rank 0..{world - 1} of its world "
                       f"size {world} once; {fix}")
    return missing
