"""`nanbisect inspect`: what a bundle holds, read from its manifest and safetensors headers.

Guarantees: imports no user code, unpickles nothing, loads no tensor data (headers only), and
first verifies the bundle as `run` does (`read_bundle`: every field's type, every file's size,
its header against what the manifest names, then its sha256), so it refuses what `run` refuses
and is safe on bundles from anyone. Its time and
memory are bounded whatever the manifest claims (see `nanbisect.bundle.format.read_bundle` and
`read_header` for the limits: a manifest of at most 64 MiB, 4M JSON values, 256 levels deep, a
world size up to 2**20 that must match the parts actually listed and present, safetensors headers
checked against the file's real size): a malformed or hostile bundle is a one-line `BadInput`.
The text form escapes control characters from the manifest (no terminal escape sequences get
through) and is bounded whatever the manifest holds: ranks are shown as ranges and a count
(`nanbisect.util.text.ranks_text`), lists by their first few items and how many more, quoted
strings cut short, and no line longer than `MAX_LINE` characters (and a note of how many more);
the JSON form (`--json`) is the summary whole, bounded by the manifest's own caps. A
directory that is not a bundle but holds bundles or leftovers of killed captures is listed
instead (`directory_summary`: directory entries and staging markers only).
Not guaranteed: time to hash tensor files that really are huge.
"""
from __future__ import annotations

import json
from pathlib import Path

from nanbisect.bundle.format import MANIFEST, Bundle, read_bundle
from nanbisect.bundle.leftovers import find_leftovers, walk
from nanbisect.bundle.manifest import Manifest, captured_on
from nanbisect.util.text import MAX_LINE, clip, ranges, ranks_text, show


def summarize(path: str | Path) -> dict:
    """A JSON-able summary of a verified bundle.

    >>> summarize("fixtures/bundles/healthy")["entry"]
    'fixtures/tasks/healthy.py:task'
    """
    b = read_bundle(path)   # NB: verifies every part of a multi-rank bundle, too
    if b.multi_rank:
        m = b.manifest
        parts = {r: _summary(b.part(int(r), verify=False)) for r in m["ranks"]}
        first = parts[min(m["ranks"], key=int)]    # rank 0's, unless the bundle is partial
        return {**first, "bundle": str(b.path), "world_size": m["world_size"], "rank": "all",
                "partial": m.get("partial") or first.get("partial"),
                "runs_top_level": first.get("runs_top_level"),
                "backend": m.get("backend"), "process_groups": m.get("process_groups"),
                "observed": {r: p["observed"] for r, p in parts.items()},
                "files": {f"rank{r}/{n}": f for r, p in parts.items()
                          for n, f in p["files"].items()},
                "shared": {f"rank{r}/{n}": f for r, p in parts.items()
                           for n, f in p["shared"].items()},
                "replicas": m.get("replicas")}
    return _summary(b)


MAX_LISTED = 1000    # bundles listed for a directory
MAX_WALKED = 20000   # directories looked at under it


def directory_summary(path: str | Path) -> dict | None:
    """For a directory that is not a bundle: the bundles under it (by name, unverified) and the
    leftovers of killed captures in it and beside those bundles (`nanbisect.bundle.leftovers`),
    or None when it holds neither.
    Reads directory entries only.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> from nanbisect.util.staging import make_staging_dir
    >>> _ = make_staging_dir(d / ".step000001.tmp-0123abcd")
    >>> directory_summary(d)["leftovers"][0]["path"].endswith(".step000001.tmp-0123abcd")
    True
    """
    root = Path(path)
    if not root.is_dir() or root.is_symlink() or (root / MANIFEST).exists():
        return None
    bundles = []     # NB: bounded: `inspect /` must not walk the whole disk
    for dirpath, dirnames, filenames in walk(root, MAX_WALKED):
        if MANIFEST in filenames and Path(dirpath) != root:
            bundles.append(str(Path(dirpath).relative_to(root)))
            dirnames[:] = []           # a multi-rank bundle's parts belong to it
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    left = find_leftovers([root], beside=[root / b for b in bundles])
    if not bundles and not left:
        return None
    return {"directory": str(root), "bundles": sorted(bundles)[:MAX_LISTED],
            "bundle_count": len(bundles), "leftovers": [x.to_json() for x in left]}


def directory_text(info: dict) -> str:
    left = info["leftovers"]
    lines = [f"directory {info['directory']}: not a bundle; it holds {info['bundle_count']} "
             f"bundle(s) and {len(left)} leftover(s) of killed captures"]
    lines += [f"  bundle    {b}" for b in info["bundles"]]
    if info["bundle_count"] > len(info["bundles"]):
        lines.append(f"  ... and {info['bundle_count'] - len(info['bundles'])} more")
    lines += [f"  leftover  {x['path']}  {x['bytes']} bytes, last written {x['age_s']:.0f}s ago"
              if x.get("marked", True) else f"  leftover  {x['path']}  no nanbisect marker (an "
              "older nanbisect's, or not nanbisect's): `nanbisect clean` keeps it" for x in left]
    where = sorted({str(Path(x["path"]).parent) for x in left if x.get("marked", True)})
    if where:
        lines.append(f"remove the leftovers with: nanbisect clean {' '.join(where)}")
    if info["bundles"]:
        lines.append("inspect a bundle with: nanbisect inspect DIRECTORY/BUNDLE")
    return "\n".join(_clean(line) for line in lines)


MAX_SHOWN = 8   # items of a list from the manifest a line shows, then how many more
MAX_FILES = 32  # files listed by inspect, then how many more and their bytes


def _more(items: list, shown: list[str]) -> str:
    """``shown`` (texts of the first items of ``items``) joined, and how many more there are."""
    more = len(items) - len(shown)
    return "; ".join(shown) + (f"; ... and {more:,} more" if more > 0 else "")


def _summary(b: Bundle) -> dict:
    m = b.manifest
    files = {}
    for name, info in m["files"].items():
        head = b.header(name)     # (read_bundle's, if kept)
        dtypes: dict[str, int] = {}
        for t in head.values():
            dtypes[t["dtype"]] = dtypes.get(t["dtype"], 0) + 1
        files[name] = {"bytes": info.get("bytes", (b.path / name).stat().st_size),
                       "tensors": len(head), "dtypes": dtypes}
    opt = m.get("optimizer")
    return {
        "bundle": str(b.path), "schema": m["schema"], "created": m.get("created"),
        "entry": m["entry"], "step": m.get("step"), "world_size": m.get("world_size"),
        "rank": m.get("rank"), "environment": m.get("environment"), "devices": m.get("devices"),
        "dtypes": m.get("dtypes"), "observed": m.get("observed"),
        "model": {"parameters": len(m["model"]["params"]), "buffers": len(m["model"]["buffers"]),
                  "tied": m["model"]["aliases"]},
        "optimizer": None if opt is None else {"class": opt["class"],
                                               "param_groups": len(opt["param_groups"])},
        "files": files, "checksums": "ok",
        # the Task opted in to running its entry's top level at import (said before a replay)
        "runs_top_level": Manifest.of(m).runs_top_level,
        # parts of the state the capture could not write ([{part, why}]: a foreign optimizer)
        "partial": m.get("partial") if isinstance(m.get("partial"), list) else None,
        # Guard(history=N) / Guard(lookback=K): how many steps the bundle can tell about / replay
        "history_steps": _count(m.get("history"), "entries"),
        "lookback_steps": _count(m.get("lookback"), "steps"),
        # tensors a part of a multi-rank bundle takes from a lower rank's file (checked by
        # `format._borrowed` when read through its bundle; a part inspected alone is not)
        "shared": {name: {k: ref.get(k) if type(ref.get(k)) is int else None
                          for k in ("rank", "tensors", "bytes")}
                   for name, ref in (m.get("shared") or {}).items() if isinstance(ref, dict)},
    }


def _count(section, key: str) -> int | None:
    """The length of ``section[key]`` when it is a list (an untrusted manifest), else None."""
    items = section.get(key) if isinstance(section, dict) else None
    return len(items) if isinstance(items, list) else None


def _clean(line: str) -> str:
    """A line safe for a terminal: control characters (ESC, CR, newlines from the manifest)
    shown escaped, at most `MAX_LINE` characters (and a note of how many more)."""
    if line.isprintable() and len(line) <= MAX_LINE:
        return line
    return clip(line, MAX_LINE)


def summary_text(info: dict) -> str:
    env = info.get("environment") or {}
    tied = info["model"]["tied"]
    lines = [f"bundle    {info['bundle']}  ({info['schema']}, checksums {info['checksums']})",
             f"entry     {clip(info['entry'], 300)}", f"step      {info['step']}   world size "
             f"{info['world_size']}   rank {info['rank']}",
             f"captured  {clip(info['created'], 40)} on {captured_on(info.get('devices'))} "
             f"with torch {clip(env.get('torch'), 40)}, python {clip(env.get('python'), 60)}",
             "machine   " + hardware_text(env.get("hardware") if isinstance(env, dict) else None),
             f"model     {info['model']['parameters']} parameters, {info['model']['buffers']} "
             f"buffers, dtypes {clip(info['dtypes'], 120)}"
             + (f", tied {clip(tied, 200)}" if tied else ""),
             f"optimizer {clip(info['optimizer']['class'], 120) if info['optimizer'] else '-'}",
             "observed  " + _observed_text(info.get("observed"))]
    if info.get("history_steps") is not None or info.get("lookback_steps") is not None:
        lookback = info.get("lookback_steps") or 0
        lines.append(f"steps     history of {info.get('history_steps') or 0}, " + (
            f"replayable with --steps up to {lookback}" if lookback else
            "no lookback (--steps needs a bundle captured with Guard(..., lookback=K))"))
    if info.get("runs_top_level"):
        lines.append("top level the entry's module-level code runs when replayed (the Task "
                     "opted in: run_top_level=True); read it before you run this bundle")
    if isinstance(info.get("partial"), dict):
        lines.append("partial   " + partial_text(info["partial"]))
    elif info.get("partial"):    # parts of the state left out: [{part, why}]
        lines.append("partial   " + "; ".join(f"{clip(e['part'], 40)} not written "
                                               f"({clip(e['why'], 160)})"
                                               for e in info["partial"][:4]))
    groups = info.get("process_groups")
    if groups and len(groups) > 1:   # more than the world: the job's layout
        lines.append("groups    " + _more(list(groups), [
            f"{clip(n, 40)}: [{ranges(r, 4)}]" for n, r in list(groups.items())[:MAX_SHOWN]]))
    if info.get("replicas") is not None:
        lines.append("replicas  " + replicas_text(info["replicas"]))
    files = list(info["files"].items())
    for name, f in files[:MAX_FILES]:
        lines.append(f"  {name:<22} {f['bytes']:>10} bytes  {f['tensors']:>4} tensors  "
                     f"{f['dtypes']}")
    if len(files) > MAX_FILES:      # a rank's files each: a 4,096-rank bundle, 16k lines
        rest = [f for _, f in files[MAX_FILES:]]
        lines.append(f"  ... and {len(rest):,} more files, "
                     f"{sum(f['bytes'] for f in rest if isinstance(f['bytes'], int)):,} bytes "
                     "(inspect --json lists them all)")
    shared = list((info.get("shared") or {}).items())
    for name, f in shared[:MAX_FILES]:
        n = {k: "?" if v is None else v for k, v in f.items()}
        lines.append(f"  {name:<22} {n['bytes']:>10} bytes  {n['tensors']:>4} tensors  in rank "
                     f"{n['rank']}'s file (written once)")
    if len(shared) > MAX_FILES:
        lines.append(f"  ... and {len(shared) - MAX_FILES:,} more shared tensors' files")
    return "\n".join(_clean(line) for line in lines)


def hardware_text(hardware) -> str:
    """One line on a manifest's ``environment.hardware`` (untrusted: any JSON): per device type
    its model and capability, what a replay on another machine is compared by.

    >>> hardware_text({"cpu": {"processor": "AMD EPYC", "capability": "AVX512"}})
    'cpu AMD EPYC (AVX512)'
    >>> hardware_text(None)
    'unknown (no fingerprint: captured by an older nanbisect)'
    """
    if not isinstance(hardware, dict):
        return "unknown (no fingerprint: captured by an older nanbisect)"
    out = []
    for name, fp in list(hardware.items())[:4]:
        fp = fp if isinstance(fp, dict) else {}
        model = fp.get("devices") if isinstance(fp.get("devices"), list) else fp.get("processor")
        if isinstance(model, list):
            model = ", ".join(str(m)[:60] for m in model[:2]) + (
                f" and {len(model) - 2} more" if len(model) > 2 else "")
        cap = fp.get("capability")
        cap = cap[0] if isinstance(cap, list) and cap else cap
        out.append(f"{str(name)[:20]} {str(model or '?')[:140]}"
                   + (f" ({str(cap)[:30]})" if cap else ""))
    return "; ".join(out) or "-"


def partial_text(partial: dict) -> str:
    """One line on a partial bundle's ``partial`` (what `schema.check_partial` accepted):
    the missing ranks as ranges and a count, the reasons of the first two that give one, each
    cut short.

    >>> partial_text({"missing_ranks": [1], "reasons": {"1": "disk full"}}).split("; ")[0]
    "rank 1 could not write its part (rank 1: 'disk full')"
    >>> partial_text({"missing_ranks": list(range(1, 1 << 20))}).split("; ")[0]
    'ranks 1-1048575 (1,048,575 ranks) could not write their parts'
    """
    missing, reasons = partial["missing_ranks"], partial.get("reasons") or {}
    said = [f"rank {r}: {show(reasons[r], 120)}" for r in sorted(reasons, key=int)[:2]]
    more = len(reasons) - len(said)
    said_text = "; ".join(said) + (f"; {more:,} more reasons" if more > 0 else "")
    return (f"{ranks_text(missing)} could not write "
            + ("its part" if len(missing) == 1 else "their parts")
            + (f" ({said_text})" if said else "") + "; replay the others with --ranks")


def replicas_text(rep: dict) -> str:
    """One line on a multi-rank bundle's ``replicas`` (what `schema.check_replicas` accepted):
    the first four groups and the first two rows out of sync, ranks as ranges, names cut short.

    >>> for part in replicas_text({
    ...         "groups": [[0, 1]], "shared_bytes": 2048, "shared_tensors": 3,
    ...         "out_of_sync": [{"tensor": "model:fc.weight", "ranks": [[0], [1]],
    ...                          "max_abs_diff": 0.25}], "out_of_sync_count": 1}).split("; "):
    ...     print(part)
    data-parallel group(s) [0-1]
    2048 bytes (3 tensors) written once instead of per rank
    1 tensor(s) out of sync: model:fc.weight (ranks 0 vs 1, max |diff| 0.25)
    """
    groups = rep.get("groups") or []
    shown = ", ".join(f"[{ranges(g, 4)}]" for g in groups[:4]) + (
        f" and {len(groups) - 4:,} more" if len(groups) > 4 else "")
    text = (f"data-parallel group(s) {shown}; " if groups else "") + (
        f"{rep.get('shared_bytes', 0)} bytes ({rep.get('shared_tensors', 0)} tensors) written "
        "once instead of per rank")
    rows, count = rep.get("out_of_sync") or [], rep.get("out_of_sync_count", 0)
    if rows or count:
        text += f"; {count} tensor(s) out of sync: " + ", ".join(map(out_of_sync_text, rows[:2]))
        if count > 2:
            text += f" and {count - 2} more"
    elif groups:
        text += "; replicas in sync"
    if rep.get("uncompared"):
        text += f"; {ranks_text(rep['uncompared'])} not compared tensor by tensor"
    return text


def out_of_sync_text(row: dict) -> str:
    """``model:fc.weight (ranks 0 vs 1, max |diff| 0.25)``: each side's ranks as ranges, the
    first four sides, the name and a textual diff cut short."""
    diff = row.get("max_abs_diff")
    extra = (f", missing on {ranks_text(row['missing'], 2)}" if row.get("missing") else "") + (
        f", max |diff| {diff:.3g}" if isinstance(diff, (int, float)) else
        f", max |diff| {clip(diff, 40)}" if diff is not None else "")
    return f"{clip(row['tensor'], 100)} (ranks {sides_text(row['ranks'])}{extra})"


def sides_text(sides: list) -> str:
    """Groups of ranks that agree (``[[0, 1], [2]]``) as '0-1 vs 2': the first three, each as
    ranges.

    >>> sides_text([[0, 1], [2]]), sides_text([[r] for r in range(6)])
    ('0-1 vs 2', '0 vs 1 vs 2 vs ... (6 groups)')
    """
    shown = " vs ".join(ranges(s, 2) for s in sides[:3])
    return shown + (f" vs ... ({len(sides):,} groups)" if len(sides) > 3 else "")


def _observed_text(obs, top: bool = True) -> str:
    if not obs:
        return "- (captured on demand, no failure recorded)"
    if not isinstance(obs, dict):
        return clip(json.dumps(obs), 200)
    if "summary" not in obs:
        if top and all(isinstance(o, dict) or o is None for o in obs.values()):
            # multi-rank: one entry per rank
            return _more(list(obs), [f"rank {clip(r, 10)}: {_observed_text(o, False)}"
                                     for r, o in list(obs.items())[:4]])
        return clip(json.dumps(obs), 200)
    return clip(json.dumps(obs.get("summary")), 200) + \
        f" (first bad: {clip(obs.get('first'), 120)})"
