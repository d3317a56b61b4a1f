"""Is the replay the captured step? What a verdict of "transient" or "device" must first rule out.

A replay is faithful when it runs the captured code (the entry file and every user source file,
by sha256: `bundle.code`; a replay of the bundle's stored copies, `bundle.codestore`, is
compared with those copies, so it runs the captured code unless a copy was left out),
and, where the captured loss was finite and the replay runs on the
capture device at the capture dtype, gives that loss bit for bit. An ``--entry`` other than the
captured one (another function, or a file whose sha256 is not the captured entry file's) is
changed code. `check` gathers the evidence;
`Fidelity.causes` names the likely reasons when the loss differs. On the CPU the replay also runs
with the intra-op thread count of the capture (`match_threads`): reductions split by threads
round differently.

A replay on other hardware (`hardware_changes`: the capture machine's fingerprint,
``manifest.environment.hardware``, against this one's, for the device the replay runs on) or
with other versions may differ in the last bits and still compute the captured step: there a loss
within the step-level tolerance of the target dtype (``rtol``, as ``--steps`` uses) is
``within-tolerance``, never a mismatch (`nanbisect.records.fidelity_tier`); a bundle without a
fingerprint is "hardware unknown" and gets the same benefit. Not guaranteed: that two machines
with the same fingerprint compute alike (a BIOS setting, a microcode, an MKL variable are not in
it), nor that a difference within tolerance has no other cause.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from nanbisect import devices
from nanbisect.bundle.manifest import Manifest
from nanbisect.bundle.code import changed_sources, relocation
from nanbisect.bundle.codestore import CODE_DIR, stored_copy
from nanbisect.bundle.format import Bundle, environment
from nanbisect.records import Fidelity
from nanbisect.util.files import file_sha256
from nanbisect.util.numbers import omp_threads

# versions and settings whose change can alter a step's numbers
_COMPARED = ("torch", "python", "nanbisect", "numpy", "torch_threads")


def match_threads(bundle: Bundle, device: torch.device) -> str | None:
    """On the CPU, use the capture's intra-op thread count; say so when it changes anything.

    Never more than this process was given (`omp_threads`: ``OMP_NUM_THREADS``, a triage
    worker's share of the cores): two replays side by side, each
    forced to the capture's count, would spin-wait on each other's cores. A replay with fewer
    threads than the capture computes the same ops, but the reductions torch splits by thread
    (sums and norms over many elements, a matrix product's inner dimension in some kernels)
    add in another order and may differ in the last bits: `check` then lists the thread count
    among what changed, so the loss is compared within the dtype's tolerance, not bit for bit.
    """
    want = Manifest.of(bundle).torch_threads
    have = torch.get_num_threads()
    if not devices.on_host(device) or not isinstance(want, int) or want < 1:
        return None
    cap = omp_threads()
    if cap is not None and cap < want:
        torch.set_num_threads(cap)
        return (f"replayed with {cap} intra-op thread(s) (OMP_NUM_THREADS), the capture used "
                f"{want}: sums split by thread may differ in the last bits")
    if want == have:
        return None
    torch.set_num_threads(want)
    return f"replayed with {want} intra-op threads as captured (this machine's default: {have})"


def _fewer_threads(then, now) -> bool:
    """The replay ran with fewer intra-op threads than the capture (`match_threads`' cap)."""
    return isinstance(then, int) and isinstance(now, int) and now < then


def check(bundle: Bundle, entry: str, original, replayed: float | None, same_setup: bool,
          override: bool = False, *, device: torch.device | None = None,
          rtol: tuple[str, float] | None = None, dtype_changed: bool = False) -> Fidelity:
    """The evidence: changed code, changed environment and hardware, and how close the loss is.

    ``original`` is the manifest's observed loss (a float, "nan"/"inf", or None); ``same_setup``
    says whether the replay ran on the capture device type at the capture dtype; ``override``
    that ``entry`` is the user's ``--entry``, not the bundle's own; ``device`` the device the
    replay runs on (its hardware is compared with the capture's); ``rtol`` (dtype name,
    tolerance) the step-level tolerance of the target dtype; ``dtype_changed`` that the replay
    runs at another dtype by request."""
    view = Manifest.of(bundle)
    captured_entry = view.entry_file
    now_entry = entry.rpartition(":")[0]
    # a replay of the bundle's stored copy (`nanbisect.bundle.codestore`) is compared with the
    # stored files: the captured code, not "changed"
    moved = _stored_root(bundle, now_entry) or relocation(
        captured_entry, now_entry if now_entry.endswith(".py") else None)
    changed, missing = changed_sources(view.sources, moved)
    other = override and _other_entry(view, entry, captured_entry, view.sources,
                                      _own_files(bundle))
    if other:
        changed = [other, *changed]
    then, now = view.environment, environment()
    env = [f"{k} {then[k]} at capture, {now[k]} now" for k in _COMPARED
           if k in then and str(then[k]) != str(now[k])
           and not (k == "torch_threads" and same_setup and view.captured_on_host
                    and not _fewer_threads(then[k], now[k]))]
    bit_exact = (replayed == original if isinstance(original, float) and replayed is not None
                 else None)
    rel = None
    if bit_exact is False and isinstance(replayed, float):
        d = abs(replayed - original)
        rel = d / abs(original) if original else (0.0 if d == 0 else math.inf)
        rel = rel if rel == rel else math.inf
    hardware = view.hardware
    changed_hw = (hardware_changes(hardware or {}, devices.fingerprint(), view.captured_on,
                                   device) if device is not None else [])
    return Fidelity(changed, env, same_setup, bit_exact, missing, changed_hw,
                    hardware is not None, rel, rtol[1] if rtol else None,
                    rtol[0] if rtol else None, dtype_changed)


# per-device values of a fingerprint (lists in device order): one device's is compared
_PER_DEVICE = ("devices", "capability", "memory")
_MAX_CHANGES = 16    # a manifest's fingerprint is untrusted: its differences are bounded too


def hardware_changes(then: dict, now: dict, captured_on: str, device: torch.device
                     ) -> list[str]:
    """What differs between the capture machine's fingerprint ``then`` and this machine's
    ``now`` (`nanbisect.devices.fingerprint`) for the replay's ``device``: the device type when
    it is another (with what each was), else each value both fingerprints know that differs.

    >>> hardware_changes({"cpu": {"capability": "AVX512"}}, {"cpu": {"capability": "DEFAULT"}},
    ...                  "cpu", torch.device("cpu"))
    ['cpu capability: AVX512 at capture, DEFAULT now']
    """
    ctype, _, cindex = str(captured_on).partition(":")
    cidx = int(cindex) if cindex.isdigit() else 0
    tidx = device.index or 0
    mine, theirs = now.get(device.type), then.get(ctype)
    if ctype != device.type:
        return [f"captured on {captured_on} ({_describe(theirs, cidx)}), replayed on "
                f"{device} ({_describe(mine, tidx)})"]
    if not isinstance(mine, dict) or not isinstance(theirs, dict):
        return []
    out = []
    for key in theirs:
        if key not in mine:
            continue          # unknown on one side: not compared, never guessed
        a, b = _pick(key, theirs[key], cidx), _pick(key, mine[key], tidx)
        if a != b:
            out.append(f"{device.type} {_show(key)}: {_show(a)} at capture, {_show(b)} now")
    return out[:_MAX_CHANGES]


def _pick(key: str, value, index: int):
    if key in _PER_DEVICE and isinstance(value, list):
        return value[index] if index < len(value) else None
    return value


def _show(value) -> str:
    """A fingerprint's value (the manifest's: any JSON) on one line, at most 80 characters."""
    text = value if isinstance(value, str) and value.isprintable() else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(fp, index: int) -> str:
    """A device type's fingerprint in a few words: its model and capability."""
    if not isinstance(fp, dict):
        return "no fingerprint"
    name = _pick("devices", fp.get("devices"), index) or fp.get("processor")
    cap = _pick("capability", fp.get("capability"), index)
    words = [_show(x) for x in (name, cap) if x]
    return ", ".join(words) or "no fingerprint"


def _stored_root(bundle: Bundle, entry_file: str) -> tuple[Path, Path] | None:
    """(the captured root, the ``code/`` holding its copy) when ``entry_file`` is a stored copy
    of ``bundle``'s code (or of another rank's part of its multi-rank bundle); else None."""
    root = Manifest.of(bundle).code_root
    if not entry_file.endswith(".py") or root is None:
        return None
    f = Path(entry_file).resolve()
    for d in f.parents:
        if d.name == CODE_DIR:
            return (Path(root), d) if (d.parent / "manifest.json").is_file() else None
    return None


def _own_files(bundle: Bundle) -> set[Path]:
    """The files a replay of ``bundle``'s own entry may import: the local entry file as
    `nanbisect.replay.replayer.code_choice` finds it and the stored copy."""
    view = Manifest.of(bundle)
    out = set()
    rel, then = view.entry_file_from_bundle, view.capture_entry_file
    for cand in ([bundle.path / rel] if rel else []) + [Path(view.entry_target)] + (
            [Path(then)] if then else []):
        if cand.is_file():
            out.add(cand.resolve())
    stored = stored_copy(bundle.path, bundle.manifest, view.code_entry_file)
    return out | ({stored.resolve()} if stored is not None else set())


def _other_entry(view: Manifest, entry: str, captured_file: str | None,
                 sources: dict[str, str], own: set[Path] = frozenset()) -> str | None:
    """How the entry the replay runs differs from the captured one (``--entry``), or None when
    it is the captured entry, also as a moved copy of the same file, or the bundle's own entry
    file (``own``: here or stored; a change in it is the code's, `changed_sources`)."""
    if entry == view.entry:
        return None
    target, _, func = entry.rpartition(":")
    captured_func = view.entry_function
    if func == captured_func and target.endswith(".py") and Path(target).resolve() in own:
        return None
    then = sources.get(captured_file) if captured_file else None
    now = file_sha256(Path(target), missing_ok=True) if target.endswith(".py") else None
    if func == captured_func and (then is None or now == then) and (
            then is not None or target == view.entry_target):
        return None
    return f"--entry {entry} (captured: {view.entry})"


def tier_notes(f: Fidelity, target: str) -> list[str]:
    """What a report says about how close its replay came to the capture, naming what differs
    (empty when it was bit for bit on the same hardware)."""
    tol = (f"the {f.tolerance_dtype} step tolerance {f.tolerance:g}"
           if f.tolerance is not None else "the step tolerance")
    rel = f"a relative {f.loss_rel_diff:.3g}" if f.loss_rel_diff is not None else "some margin"
    if f.hardware_changed:
        short, where = "other hardware", ("other hardware than the capture's: "
                                          + "; ".join(f.hardware_changed))
    elif not f.hardware_known:
        short, where = "an unknown machine", (
            "hardware the bundle does not record (no fingerprint: captured by an older "
            "nanbisect), so it may be another machine")
    elif f.environment_changed:
        short, where = "other versions", "other versions than the capture's (listed above)"
    elif not f.same_setup:
        short, where = "another device or dtype", f"{target}, not the capture device or dtype"
    else:
        short, where = "", "the same hardware and software as the capture"
    tier = f.tier
    if tier == "within-tolerance":
        return [f"the replay is within tolerance, not bit for bit: its loss differs from the "
                f"captured one by {rel}, within {tol}, on {where}; last-bit differences are "
                "expected there, and the verdict stands"]
    if tier == "mismatch" and f.dtype_changed:
        return [f"the replay runs at another dtype than the capture ({target}) and its loss "
                f"differs from the captured one by {rel}, beyond {tol}: expected of the dtype "
                "asked for; no verdict about the replay's fidelity follows from it"]
    if tier == "mismatch":
        why = (f"on {where} the loss must come back bit for bit" if not f.elsewhere else
               f"on {where}, but beyond {tol}: more than {short} explains")
        return [f"the replay does not compute the captured step: its loss differs from the "
                f"captured one by {rel} (bit_exact false; {why}); likely causes: {f.causes()}"]
    if f.hardware_changed:
        return [f"the replay ran on {where}" + ("; its loss is the captured one bit for bit"
                                              if tier == "bit-exact" else "")]
    return []
