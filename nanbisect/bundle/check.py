"""What a manifest names, checked against its bundle's safetensors headers, no tensor data read:
the one validation `read_bundle` runs for `inspect` and `run` alike, so that a bundle one of them
refuses the other refuses too.

Guarantees: every tensor the manifest names (the model's parameters and buffers, the batch, the
optimizer state, the RNG states, the history's norms, the lookback's snapshot and steps) is in
the file its reader takes it from, with the dtype and size that reader needs, and every tensor
of the model, optimizer, batch and RNG files is one the manifest names; every tagged value of
the batch and the optimizer state decodes (`nanbisect.bundle.state`'s own decoders, fed meta
tensors built from the headers); the RNG state, history, lookback and recorded collectives have
the shape their readers take (their own parsers). Bounded by the headers' and the manifest's
sizes, which `nanbisect.bundle.bounded` bounds.
Not checked: what only the entry's code can tell (its model's parameter names and shapes, its
optimizer's groups and state), and values inside tensor data (an RNG state a generator refuses).
"""
from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from pathlib import Path

import torch

from nanbisect import devices
from nanbisect import history as hist
from nanbisect.bundle import tape
from nanbisect.bundle.schema import ROLES, SUFFIX, field_problem
from nanbisect.bundle.state import RngState, decode, decode_optimizer, model_keys
from nanbisect.errors import BadInput
from nanbisect.util.text import show

# safetensors dtype -> torch dtype (the names `nanbisect.bundle.bounded.DTYPE_BITS` accepts)
TORCH_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
                "F8_E5M2": torch.float8_e5m2, "F8_E4M3": torch.float8_e4m3fn,
                "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
                "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
                "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
                "U64": torch.uint64, "C64": torch.complex64}
LOOKBACK = "lookback"
MAX_LOOKBACK_STEPS = 1 << 14
_FIX = "the manifest was altered or damaged: re-capture the bundle"


class HeaderTensors(Mapping):
    """Tensor name -> a tensor on the ``meta`` device with the dtype and shape a safetensors
    header gives it (no data): what the decoders of `nanbisect.bundle.state` take in place of
    the loaded tensors. ``used`` collects the names looked up.

    >>> t = HeaderTensors({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}})
    >>> t["a"].shape, t["a"].device.type, "a" in t.used
    (torch.Size([2, 3]), 'meta', True)
    """

    def __init__(self, heads: Mapping[str, dict]) -> None:
        self.heads = heads
        self.used: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        e = self.heads[name]
        self.used.add(name)
        try:
            return torch.empty(e["shape"], dtype=TORCH_DTYPES[e["dtype"]], device=devices.SHAPES)
        except (RuntimeError, ValueError, OverflowError, TypeError):
            raise BadInput(f"tensor {show(name)} has shape {show(e['shape'], 40)}, which torch "
                           "cannot hold; re-capture the bundle") from None

    def __contains__(self, name) -> bool:
        found = isinstance(name, str) and name in self.heads
        if found:
            self.used.add(name)
        return found

    def __iter__(self):
        return iter(self.heads)

    def __len__(self) -> int:
        return len(self.heads)


def check_state(p: Path, m: dict, heads: dict[str, dict],
                borrowed: dict[str, dict] | None = None) -> None:
    """`BadInput` unless the manifest ``m`` of bundle (or part) ``p`` and its files' headers
    ``heads`` (file name -> header) fit together as the module docstring says. ``borrowed``: a
    part's tensors held by lower ranks' files (file name -> {tensor: header entry}), as
    `nanbisect.bundle.format.Bundle.part` resolves them; such files may hold fewer tensors."""
    where = f"bundle '{p}'"
    try:
        _check_state(where, m, heads, borrowed or {})
    except BadInput as e:   # the decoders' own messages do not name the bundle
        if str(e).startswith("bundle '"):
            raise
        raise BadInput(f"{where}: {e}") from None


def _check_state(where: str, m: dict, heads: dict[str, dict], borrowed: dict[str, dict]
                 ) -> None:
    def role(name: str) -> dict[str, dict]:   # NB: as Bundle.tensors: own file, then borrowed
        return {**heads.get(name + SUFFIX, {}), **borrowed.get(name + SUFFIX, {})}

    merged: dict[str, dict] = {}
    for name in ROLES:   # as Bundle.all_tensors merges them
        merged.update(role(name))
    state = HeaderTensors(merged)
    model_keys(m["model"], state, where)
    decode(m["batch"], state)
    if m.get("optimizer") is not None:
        decode_optimizer(m["optimizer"], state, where)
    if m.get("lookback_groups") is not None:   # a window's step (`BundleView`), never on disk
        groups = decode(m["lookback_groups"], state)
        if not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)):
            raise BadInput(f"{where}: the manifest's lookback_groups is not a list of parameter "
                           f"groups; {_FIX}")
    RngState.check(m["rng"], state)
    extra = sorted(set(merged) - state.used)
    if extra:
        raise BadInput(f"{where}: its tensor files hold {len(extra)} tensor(s) the manifest does "
                       f"not name (e.g. {show(extra[0])}); {_FIX}")
    hist.parse(m.get("history"), HeaderTensors(role(hist.ROLE)), where)
    lookback_steps(m, HeaderTensors(role(LOOKBACK)), where)
    if m.get("collectives") is not None:
        tape.parse(m["collectives"], where)


def lookback_steps(m: dict, tensors: Mapping, where: str) -> list[dict] | None:
    """The manifest's lookback steps, oldest first, checked (``tensors``: the lookback file's,
    loaded or `HeaderTensors`): every step's batch, parameter groups and RNG decode from the
    snapshot's and its own tensors, the snapshot's model and optimizer state from the
    snapshot's; None when the bundle has no lookback."""
    lb = m.get("lookback")
    if lb is None:
        return None
    fix = "the manifest's lookback was altered or damaged; re-capture the bundle"
    if not isinstance(lb, dict) or lb.get("schema") != 1:
        raise BadInput(f"{where}: unreadable lookback (schema 1 expected); {fix}")
    steps = lb.get("steps")
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_LOOKBACK_STEPS or not all(
            isinstance(s, dict) and type(s.get("step")) is int and isinstance(s.get("rng"), dict)
            and "batch" in s and "groups" in s for s in steps):
        raise BadInput(f"{where}: the lookback's steps are not a list of {{step, rng, batch, "
                       f"groups}}; {fix}")
    numbers = [s["step"] for s in steps]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))) or \
            lb.get("start_step") != numbers[0] or type(lb.get("k")) is not int:
        raise BadInput(f"{where}: the lookback's steps are not consecutive from its start step; "
                       f"{fix}")
    if numbers[-1] != m.get("step"):
        raise BadInput(f"{where}: the lookback ends at step {numbers[-1]}, not at the bundle's "
                       f"step {m.get('step')}; {fix}")
    if "model" not in lb:
        raise BadInput(f"{where}: the lookback has no model section; {fix}")
    for key in ("model", "optimizer", "grad_scaler"):
        want = field_problem(key, lb.get(key))
        if want is not None:
            raise BadInput(f"{where}: the lookback's {key} is not {want}; {fix}")
    if not all(isinstance(s["groups"], (list, dict)) for s in steps):
        raise BadInput(f"{where}: the lookback's parameter groups are malformed; {fix}")
    # what `Window.state_view` / `BundleView.with_step` hand the replay: step i's own tensors
    # (prefix s{i}/) over the snapshot's (prefix snap/)
    own: dict[str, dict] = {"snap": {}}
    for name in tensors:
        prefix, sep, rest = name.partition("/")
        if sep:
            own.setdefault(prefix, {})[rest] = name
    snap = _Renamed(tensors, own["snap"])
    model_keys(lb["model"], snap, f"{where} (lookback)")
    if lb.get("optimizer") is not None:
        decode_optimizer(lb["optimizer"], snap, f"{where} (lookback)")
    for i, s in enumerate(steps):
        view = ChainMap(_Renamed(tensors, own.get(f"s{i}", {})), snap)
        decode(s["batch"], view)
        decode(s["groups"], view)
        RngState.check(s["rng"], view)
    return steps


class _Renamed(Mapping):
    """``tensors`` seen under other names (short name -> name in ``tensors``)."""

    def __init__(self, tensors: Mapping, names: dict[str, str]) -> None:
        self.tensors, self.names = tensors, names

    def __getitem__(self, name: str):
        return self.tensors[self.names[name]]

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
