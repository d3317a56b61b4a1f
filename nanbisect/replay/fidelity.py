"""Is the replay the captured step? What a verdict of "transient" or "device" must first rule out.

A replay is faithful when it runs the captured code (the entry file and every user source file,
by sha256: `bundle.code`), and, where the captured loss was finite and the replay runs on the
capture device at the capture dtype, gives that loss bit for bit. An ``--entry`` other than the
captured one (another function, or a file whose sha256 is not the captured entry file's) is
changed code. `check` gathers the evidence;
`Fidelity.causes` names the likely reasons when the loss differs. On the CPU the replay also runs
with the intra-op thread count of the capture (`match_threads`): reductions split by threads
round differently.
"""
from __future__ import annotations

from pathlib import Path

import torch

from nanbisect.bundle.code import changed_sources, relocation
from nanbisect.bundle.format import Bundle, environment
from nanbisect.records import Fidelity
from nanbisect.util.files import file_sha256

# versions and settings whose change can alter a step's numbers
_COMPARED = ("torch", "python", "nanbisect", "numpy", "torch_threads")


def match_threads(bundle: Bundle, device: torch.device) -> str | None:
    """On the CPU, use the capture's intra-op thread count; say so when it changes anything."""
    want = (bundle.manifest.get("environment") or {}).get("torch_threads")
    have = torch.get_num_threads()
    if device.type != "cpu" or not isinstance(want, int) or want < 1 or want == have:
        return None
    torch.set_num_threads(want)
    return f"replayed with {want} intra-op threads as captured (this machine's default: {have})"


def check(bundle: Bundle, entry: str, original, replayed: float | None, same_setup: bool,
          override: bool = False) -> Fidelity:
    """The evidence: changed code, changed environment, and whether the loss is bit-exact.

    ``original`` is the manifest's observed loss (a float, "nan"/"inf", or None); ``same_setup``
    says whether the replay ran on the capture device at the capture dtype; ``override`` that
    ``entry`` is the user's ``--entry``, not the bundle's own."""
    m = bundle.manifest
    code = m.get("code") or {}
    captured_entry = code.get("entry_file") or m.get("entry_file")
    now_entry = entry.rpartition(":")[0]
    moved = relocation(captured_entry, now_entry if now_entry.endswith(".py") else None)
    changed, missing = changed_sources(code.get("sources") or {}, moved)
    other = override and _other_entry(m, entry, captured_entry, code.get("sources") or {})
    if other:
        changed = [other, *changed]
    then, now = m.get("environment") or {}, environment()
    env = [f"{k} {then[k]} at capture, {now[k]} now" for k in _COMPARED
           if k in then and str(then[k]) != str(now[k])
           and not (k == "torch_threads" and same_setup and _cpu(m))]
    bit_exact = (replayed == original if isinstance(original, float) and replayed is not None
                 else None)
    return Fidelity(changed, env, same_setup, bit_exact, missing)


def _other_entry(m: dict, entry: str, captured_file: str | None, sources: dict[str, str]
                 ) -> str | None:
    """How the entry the replay runs differs from the captured one (``--entry``), or None when
    it is the captured entry, also as a moved copy of the same file."""
    if entry == m.get("entry"):
        return None
    target, _, func = entry.rpartition(":")
    captured_func = str(m.get("entry", "")).rpartition(":")[2]
    then = sources.get(captured_file) if captured_file else None
    now = file_sha256(Path(target), missing_ok=True) if target.endswith(".py") else None
    if func == captured_func and (then is None or now == then) and (
            then is not None or target == str(m.get("entry", "")).rpartition(":")[0]):
        return None
    return f"--entry {entry} (captured: {m.get('entry')})"


def _cpu(manifest: dict) -> bool:
    return str((manifest.get("devices") or {}).get("captured_on", "cpu")).startswith("cpu")
