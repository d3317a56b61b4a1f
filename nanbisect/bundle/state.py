"""Turn training state into JSON-able metadata plus a flat dict of tensors, and back.

Guarantees: nothing here pickles or evaluates anything; every non-tensor value is encoded as plain
JSON with explicit tags (``__tuple__``, ``__float__`` for nan/inf, ...). Decoding an altered or
damaged manifest (a tag of the wrong shape, a name that is not a torch dtype, device, layout or
memory format, a missing tensor, an RNG state a generator refuses) is `BadInput`, never another
exception. Tied parameters are stored
once and restored by copying into the model the entry builds, so ties made by the model's own
constructor survive. Not guaranteed: arbitrary Python objects inside a batch (only tensors, numbers,
strings, bools, None, lists, tuples and dicts are accepted), or optimizers whose state holds
non-tensor objects other than those plain values.
"""
from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from nanbisect import devices
from nanbisect.bundle.code import is_user_file
from nanbisect.bundle.lazy import fill
from nanbisect.errors import BadInput

Tensors = dict[str, torch.Tensor]
MAX_ACCEL_STATES = 1024   # RNG states of one accelerator type (one per device) in a bundle

# --------------------------------------------------------------------------------------------
# plain values and pytrees


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2, tensor parallel), else ``t`` itself.

    The shard shares storage with the DTensor, so writing into it writes the DTensor. Everything
    nanbisect reads or writes per rank goes through here: a DTensor-level op (``isnan().any()``,
    ``sum``) could issue a collective, which must never happen outside the step.
    """
    if type(t) is not torch.Tensor and hasattr(t, "to_local") and hasattr(t, "placements"):
        return t.to_local()
    return t


def _tensor_for_file(t: torch.Tensor) -> torch.Tensor:
    # NB: safetensors refuses tensors that share storage; a detached contiguous clone never does.
    return local(t).detach().to(devices.HOST).contiguous().clone()


def encode(obj: Any, key: str, tensors: Tensors, copy: Callable = _tensor_for_file) -> Any:
    """Encode a pytree as JSON, moving its tensors into ``tensors`` under keys below ``key``
    (each as ``copy(tensor)``: by default a CPU copy ready for a file).

    >>> ts = {}; encode({"x": torch.ones(2), "n": 3}, "batch", ts)["__dict__"][0]
    ['x', {'__tensor__': 'batch/v0', 'requires_grad': False, 'device': 'cpu'}]
    """
    if isinstance(obj, torch.Tensor):
        tensors[key] = copy(obj)
        return {"__tensor__": key, "requires_grad": bool(obj.requires_grad),
                "device": obj.device.type}
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"__device__": str(obj)}
    if isinstance(obj, (torch.layout, torch.memory_format)):
        return {"__torch__": str(obj).removeprefix("torch.")}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        items = [encode(v, f"{key}/{i}", tensors, copy) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, dict):
        pairs = []
        for i, (k, v) in enumerate(obj.items()):
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TypeError(f"{key}: dict key {k!r} is not a plain value")
            # NB: name values by position: keys "a/b" and "a" -> "b" would collide as text
            pairs.append([encode(k, f"{key}/k{i}", tensors, copy),
                          encode(v, f"{key}/v{i}", tensors, copy)])
        return {"__dict__": pairs}
    raise TypeError(
        f"{key}: cannot store a {type(obj).__name__}; a batch may hold tensors, numbers, strings, "
        "bools, None, lists, tuples and dicts"
    )


def decode(obj: Any, tensors: Tensors, device: torch.device | str | None = None) -> Any:
    """Inverse of `encode`; tensors are moved to ``device`` when given. A tagged value of the
    wrong shape (a manifest altered or damaged) is `BadInput`, never another exception; tags only
    ever name dtypes, devices, layouts and memory formats, never another attribute of torch."""
    if isinstance(obj, list):
        return [decode(v, tensors, device) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        name = obj["__tensor__"]
        if not isinstance(name, str) or name not in tensors:
            raise BadInput(f"tensor {_show(name)} named in the manifest is missing from the "
                           "bundle's tensor files; re-capture the bundle")
        # NB: always a copy: an optimizer step or an in-place loss_fn must not alter the bundle's
        # tensors, which every later replay restores from (a mapping that reads its values
        # afresh on each access, `bundle.lazy`, gives copies already)
        t = tensors[name]
        if not getattr(tensors, "fresh", False):
            t = t.to(device, copy=True) if device is not None else t.clone()
        elif device is not None:
            t = t.to(device)
        return t.requires_grad_(True) if obj.get("requires_grad") and (
            t.is_floating_point() or t.is_complex()) else t
    if "__tuple__" in obj:
        return tuple(decode(v, tensors, device) for v in _tagged(obj, "__tuple__", list))
    if "__float__" in obj:
        text = _tagged(obj, "__float__", str)
        if text not in ("nan", "inf", "-inf"):
            _bad_tag(obj, "__float__")
        return float(text)
    if "__dtype__" in obj:
        return _torch_attr(obj, "__dtype__", (torch.dtype,))
    if "__device__" in obj:
        try:
            return torch.device(_tagged(obj, "__device__", str))
        except (RuntimeError, ValueError, ArithmeticError):
            _bad_tag(obj, "__device__")
    if "__torch__" in obj:
        return _torch_attr(obj, "__torch__", (torch.layout, torch.memory_format))
    if "__dict__" in obj:
        out = {}
        for pair in _tagged(obj, "__dict__", list):
            if not (isinstance(pair, list) and len(pair) == 2):
                _bad_tag(obj, "__dict__")
            k = decode(pair[0], tensors, device)
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                _bad_tag(obj, "__dict__")
            out[k] = decode(pair[1], tensors, device)
        return out
    raise BadInput(f"unknown tagged value {_show(sorted(obj))} in manifest; was it written by a "
                   "newer nanbisect? upgrade nanbisect")


def _show(value, limit: int = 60) -> str:
    """``value`` for a one-line message (as `nanbisect.bundle.format.show`)."""
    r = repr(value)
    if len(r) <= limit:
        return r
    return r[:limit - 4] + "..." + (r[0] if r[0] in "'\"" else "")


def _bad_tag(obj: dict, tag: str):
    raise BadInput(f"manifest value {_show(obj)} is not a valid {tag} value; the manifest was "
                   "altered or damaged: re-capture the bundle")


def _tagged(obj: dict, tag: str, kind: type):
    if not isinstance(obj[tag], kind):
        _bad_tag(obj, tag)
    return obj[tag]


def _torch_attr(obj: dict, tag: str, kinds: tuple):
    value = getattr(torch, _tagged(obj, tag, str), None)
    if not isinstance(value, kinds):
        _bad_tag(obj, tag)
    return value


def iter_tensors(obj: Any, path: str = ""):
    """Yield ``(path, tensor)`` for every tensor leaf of a pytree (lists, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        yield path or "batch", obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{path}[{k!r}]")


# --------------------------------------------------------------------------------------------
# model


def model_entries(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """Every parameter and buffer as ``(name, tensor, kind)``, tied ones under each name."""
    out = [(n, p, "param") for n, p in model.named_parameters(remove_duplicate=False)]
    out += [(n, b, "buffer") for n, b in model.named_buffers(remove_duplicate=False)]
    return out


def encode_model(model: torch.nn.Module, tensors: Tensors, copy: Callable = _tensor_for_file
                 ) -> dict:
    """Store each distinct parameter/buffer once under ``model/<name>``; ties become aliases."""
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    names = {"param": [], "buffer": []}
    for name, t, kind in model_entries(model):
        names[kind].append(name)
        if id(t) in canonical:
            aliases[name] = canonical[id(t)]
            continue
        canonical[id(t)] = name
        tensors[f"model/{name}"] = copy(t)
    return {"params": names["param"], "buffers": names["buffer"], "aliases": aliases}


def model_keys(meta: dict, tensors, where: str) -> dict[str, str]:
    """Each parameter and buffer the manifest's ``model`` lists -> its tensor's name (a tied one:
    the name it is tied to); `BadInput` when ``tensors`` (a mapping: tensors, or the headers'
    `nanbisect.bundle.check.HeaderTensors`) does not hold it.

    >>> model_keys({"params": ["a", "b"], "buffers": [], "aliases": {"b": "a"}},
    ...            {"model/a": torch.ones(1)}, "x")
    {'a': 'model/a', 'b': 'model/a'}
    """
    keys = {}
    for name in (*meta["params"], *meta["buffers"]):
        key = f"model/{meta['aliases'].get(name, name)}"
        if key not in tensors:
            raise BadInput(f"{where}: tensor {_show(key)} named in the manifest is missing from "
                           "the bundle's model.safetensors; re-capture the bundle")
        keys[name] = key
    return keys


@torch.no_grad()
def restore_model(model: torch.nn.Module, meta: dict, tensors: Tensors, where: str,
                  keep: Callable[[torch.Tensor], bool] | None = None) -> int:
    """Copy saved values into ``model`` in place (keeps ties, devices and dtypes of the model);
    ``keep(t)``: ``t`` still holds its saved value (nothing wrote it since the last restore),
    so it is not written again. How many tensors were written."""
    entries = model_entries(model)
    have = {n for n, _, _ in entries}
    want = set(meta["params"]) | set(meta["buffers"])
    if have != want:
        missing, extra = sorted(want - have)[:3], sorted(have - want)[:3]
        raise BadInput(
            f"{where}: the model built by the entry does not match the bundle (bundle only: "
            f"{missing or '-'}; model only: {extra or '-'}); replay with the code that captured it"
        )
    keys = model_keys(meta, tensors, where)
    written = 0
    for name, t, _ in entries:
        t = local(t)
        shape = _shape_of(tensors, keys[name])
        if shape != t.shape:
            raise BadInput(f"{where}: '{name}' has shape {tuple(shape)} in the bundle but "
                           f"{tuple(t.shape)} in the model; replay with the code that captured it")
        if keep is None or not keep(t):
            fill(tensors, keys[name], t)
            written += 1
    return written


def _shape_of(tensors, name: str) -> torch.Size:
    """A saved tensor's shape, without reading it from a file-backed mapping."""
    shape = getattr(tensors, "shape", None)
    return shape(name) if shape is not None else tensors[name].shape


def restore_modes(model: torch.nn.Module, meta: dict, where: str) -> None:
    """Set every module's train/eval mode and every parameter's ``requires_grad`` as captured
    (a frozen backbone in eval mode inside a training model). Bundles written before these were
    recorded leave the model as the entry built it."""
    training = meta.get("training")
    if training is not None:
        modules = dict(model.named_modules())
        unknown = sorted(set(training) - set(modules))[:3]
        if unknown:
            raise BadInput(f"{where}: the bundle records modules the entry's model lacks "
                           f"({unknown}); replay with the code that captured it")
        for name, mod in modules.items():
            if name in training:
                mod.training = bool(training[name])
    frozen = meta.get("frozen")
    if frozen is not None:
        frozen = set(frozen)
        for name, p in model.named_parameters():
            p.requires_grad_(name not in frozen)


# --------------------------------------------------------------------------------------------
# optimizer


def hyper_parameters(opt: torch.optim.Optimizer | None) -> list[dict]:
    """Each parameter group's settings (learning rate, betas, weight decay: what a scheduler
    changes between steps), without its parameters; [] without an optimizer."""
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] \
        if opt is not None else []


def encode_optimizer(opt: torch.optim.Optimizer, tensors: Tensors,
                     copy: Callable = _tensor_for_file) -> dict:
    """Store ``opt.state_dict()``: tensors under ``optim/...``, everything else as JSON. An
    optimizer adapter's state_dict may carry ``extra`` besides torch's two keys (what its
    engine keeps outside the state: DeepSpeed's loss scale), stored and given back alike."""
    sd = opt.state_dict()
    state = {str(i): encode(s, f"optim/state/{i}", tensors, copy) for i, s in sd["state"].items()}
    groups = [encode(g, f"optim/group/{j}", tensors, copy)
              for j, g in enumerate(sd["param_groups"])]
    extra = {"extra": encode(sd["extra"], "optim/extra", tensors, copy)} if sd.get("extra") \
        else {}
    return {"class": type(opt).__module__ + "." + type(opt).__qualname__,
            "state": state, "param_groups": groups, **extra}


def decode_optimizer(meta: dict, tensors, where: str) -> dict:
    """The optimizer's ``state_dict`` the manifest's ``optimizer`` holds; `BadInput` unless it
    has the shape every torch optimizer's ``load_state_dict`` reads: state keyed by parameter
    index, each an object; groups of objects, each with ``params``, a list of distinct indices
    that covers every state's index. What fits only a given optimizer (how many groups and
    parameters, which state keys) is for `restore_optimizer` to find."""
    bad = (f"{where}: the bundle's optimizer state is not {{state: {{index: {{...}}}}, "
           "param_groups: [{params: [index, ...], ...}]}; the manifest was altered or damaged: "
           "re-capture the bundle")
    if not all(isinstance(i, str) and i.isascii() and i.isdigit() and len(i) < 10
               for i in meta["state"]):
        raise BadInput(f"{where}: the bundle's optimizer state is keyed by "
                       f"{_show(sorted(meta['state'])[:3])}, not parameter indices; the manifest "
                       "was altered or damaged: re-capture the bundle")
    sd = {"state": {int(i): decode(s, tensors) for i, s in meta["state"].items()},
          "param_groups": [decode(g, tensors) for g in meta["param_groups"]]}
    if "extra" in meta:
        sd["extra"] = decode(meta["extra"], tensors)
        if not isinstance(sd["extra"], dict):
            raise BadInput(bad)
    indices = [i for g in sd["param_groups"] if isinstance(g, dict)
               for i in (g.get("params") if isinstance(g.get("params"), list) else [None])]
    if not (all(isinstance(g, dict) for g in sd["param_groups"])
            and all(isinstance(st, dict) for st in sd["state"].values())
            and all(type(i) is int for i in indices) and len(set(indices)) == len(indices)
            and set(sd["state"]) <= set(indices)):
        raise BadInput(bad)
    return sd


def same_class(recorded: str, cls: type) -> bool:
    """Whether the class a bundle recorded as ``recorded`` (``module.qualname``) is ``cls``, the
    one the entry built now. A class the training script defined while it ran as ``__main__``
    (``python train.py``) is recorded as ``__main__.Name``; the replay imports that script under
    its own name (``train``), so there ``__main__.Name`` is the class of that qualified name from
    a user source file (not torch, the standard library or an installed package). (A model's
    class is never recorded: its parameters are matched by name.)

    >>> same_class("torch.optim.sgd.SGD", torch.optim.SGD)
    True
    >>> same_class("__main__.SGD", torch.optim.SGD)     # a user's own SGD is not torch's
    False
    """
    if recorded == f"{cls.__module__}.{cls.__qualname__}":
        return True
    module, _, qualname = recorded.partition(".")
    if module != "__main__" or qualname != cls.__qualname__:
        return False
    f = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return isinstance(f, str) and is_user_file(Path(f).resolve())


def restore_optimizer(opt: torch.optim.Optimizer, meta: dict, tensors: Tensors, where: str,
                      in_place: bool = False,
                      keep: Callable[[torch.Tensor], bool] | None = None) -> int:
    """``opt``'s state and hyper-parameters := the manifest's ``optimizer`` (``meta``); how
    many state tensors were written. ``in_place``: ``opt`` holds this very state already
    restored once (and maybe stepped): its state tensors are overwritten where they are (no
    second copy of the moments, no clone), those ``keep`` vouches for not at all; or, where
    its layout differs, restored as on the first time."""
    cls = type(opt).__module__ + "." + type(opt).__qualname__
    if not same_class(meta["class"], type(opt)):
        raise BadInput(f"{where}: the bundle holds a {meta['class']} state but the entry built a "
                       f"{cls}; replay with the code that captured it")
    if in_place and "extra" not in meta:
        written = _in_place(opt, meta, tensors, keep)
        if written is not None:
            return written
    sd = decode_optimizer(meta, tensors, where)
    try:
        opt.load_state_dict(sd)
    except (LookupError, TypeError, ValueError, ArithmeticError, AttributeError,
            RuntimeError) as e:
        raise BadInput(f"{where}: optimizer state does not fit the entry's optimizer "
                       f"({type(e).__name__}: {_show(str(e), 80)[1:-1]}); replay with the code "
                       "that captured it") from None
    _shard_state_like_params(opt)
    return sum(isinstance(v, torch.Tensor) for st in opt.state.values() for v in st.values())


@torch.no_grad()
def _in_place(opt: torch.optim.Optimizer, meta: dict, tensors,
              keep: Callable[[torch.Tensor], bool] | None = None) -> int | None:
    """Overwrite ``opt``'s state with ``meta``'s where it stands (not the tensors ``keep``
    vouches for): how many tensors were written, or None (nothing written) when the state's
    layout is not the one ``meta`` describes (parameters, keys, shapes), which
    `load_state_dict` then builds afresh."""
    params = [p for g in opt.param_groups for p in g["params"]]
    saved = [_fields(g) for g in meta["param_groups"]]
    if len(saved) != len(opt.param_groups) or any(
            g is None or not isinstance(g.get("params"), list)
            or len(g["params"]) != len(c["params"]) for g, c in zip(saved, opt.param_groups)):
        return None
    index = {i: p for g, c in zip(saved, opt.param_groups)
             for i, p in zip(g["params"], c["params"])}
    state = {i: _fields(entry) for i, entry in meta["state"].items()}
    if set(opt.state) != {index.get(int(i)) for i in state} or len(params) != len(index):
        return None
    plan = []
    for i, entry in state.items():
        current = opt.state[index[int(i)]]
        if entry is None or set(entry) != set(current):
            return None
        for k, v in entry.items():
            cur = current[k]
            if isinstance(v, dict) and "__tensor__" in v:
                name = v["__tensor__"]
                if not (isinstance(cur, torch.Tensor) and isinstance(name, str)
                        and name in tensors and tuple(_shape_of(tensors, name))
                        == tuple(local(cur).shape)):
                    return None
                plan.append((name, local(cur)))
            elif isinstance(cur, torch.Tensor):
                return None
            else:
                current[k] = decode(v, tensors)
    plan = [(name, cur) for name, cur in plan if keep is None or not keep(cur)]
    for name, cur in plan:
        fill(tensors, name, cur)
    for g, c in zip(saved, opt.param_groups):
        for k, v in g.items():
            if k != "params":
                c[k] = decode(v, tensors)
    return len(plan)


def _fields(obj: Any) -> dict | None:
    """An encoded dict's fields as ``{key: encoded value}`` (keys decoded, values not: a tensor
    stays its ``{"__tensor__": ...}`` reference, unread); None for anything else (`decode`
    judges it)."""
    if not (isinstance(obj, dict) and set(obj) == {"__dict__"}
            and isinstance(obj["__dict__"], list)):
        return None
    out = {}
    for pair in obj["__dict__"]:
        if not (isinstance(pair, list) and len(pair) == 2):
            return None
        k = pair[0]
        if isinstance(k, dict):       # a tagged key (a float's "nan"): left to `decode`
            return None
        out[k] = pair[1]
    return out


def _shard_state_like_params(opt: torch.optim.Optimizer) -> None:
    """A DTensor parameter's state was saved as this rank's shard: make it a DTensor again,
    laid out like the parameter (what the optimizer built for it during training)."""
    for p, st in opt.state.items():
        if local(p) is p:
            continue
        from torch.distributed.tensor import DTensor

        shard = local(p)
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and local(v) is v and v.shape == shard.shape \
                    and v.dim() > 0:
                st[k] = DTensor.from_local(v.to(shard.device), p.device_mesh, p.placements,
                                           run_check=False, shape=p.shape, stride=p.stride())


# --------------------------------------------------------------------------------------------
# RNG


def accelerator_types() -> list[str]:
    """Device types other than CPU whose RNG torch exposes on this machine (the device seam's
    registered types that are available)."""
    return devices.accelerators()


@dataclass(frozen=True)
class RngState:
    """The generator states a training step may draw from."""

    python: tuple
    numpy: tuple
    torch_cpu: torch.Tensor
    accel: dict[str, list[torch.Tensor]]

    @staticmethod
    def get(accel_types: list[str]) -> "RngState":
        acc = {}
        for name in accel_types:
            acc[name] = devices.entry(name).get_rng()
        return RngState(random.getstate(), np.random.get_state(),
                        devices.entry(devices.HOST).get_rng()[0], acc)

    def set(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        devices.entry(devices.HOST).set_rng([self.torch_cpu])
        for name, states in self.accel.items():
            dt = devices.entry(name)
            if not dt.available():
                continue  # replaying elsewhere: that device's draws cannot matter
            dt.set_rng(states)

    def encode(self, tensors: Tensors) -> dict:
        version, words, gauss = self.python
        kind, keys, pos, has_gauss, cached = self.numpy
        tensors["rng/torch_cpu"] = self.torch_cpu.clone()
        tensors["rng/numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
        tensors["rng/python_words"] = torch.tensor(words, dtype=torch.int64)
        for name, states in self.accel.items():
            for i, s in enumerate(states):
                tensors[f"rng/{name}/{i}"] = s.detach().to(devices.HOST).clone()
        return {"python": [version, gauss],
                "numpy": [kind, int(pos), int(has_gauss), float(cached)],
                "accel": {name: len(states) for name, states in self.accel.items()}}

    @staticmethod
    def check(meta, tensors) -> None:
        """`BadInput` unless ``meta`` has the shape `encode` writes and ``tensors`` (a mapping:
        tensors, or the headers' `nanbisect.bundle.check.HeaderTensors`) hold its tensors with
        their dtypes and sizes: all of `decode` that reads no tensor data."""
        def bad(why: str):
            raise BadInput(f"the bundle's RNG state is incomplete or malformed ({why}); "
                           "re-capture the bundle")

        if not isinstance(meta, dict):
            bad(f"it is {type(meta).__name__}, not an object")
        py, npy, acc = meta.get("python"), meta.get("numpy"), meta.get("accel")
        if not (isinstance(py, list) and len(py) == 2 and type(py[0]) is int and py[0] == 3
                and (py[1] is None or type(py[1]) is float)):
            bad(f"'python' is {_show(py, 40)}, not [3, gauss: null or a number]")
        if not (isinstance(npy, list) and len(npy) == 4 and npy[0] == "MT19937"
                and type(npy[1]) is int and 0 <= npy[1] <= 624 and type(npy[2]) is int
                and npy[2] in (0, 1) and type(npy[3]) in (int, float)):
            bad(f"'numpy' is {_show(npy, 40)}, not ['MT19937', position 0..624, has_gauss 0 "
                "or 1, gauss]")
        if not (isinstance(acc, dict) and all(type(n) is int and 0 <= n <= MAX_ACCEL_STATES
                                              for n in acc.values())):
            bad(f"'accel' is {_show(acc, 40)}, not {{device type: number of states}}")
        want = [("rng/python_words", torch.int64, 625), ("rng/numpy_keys", torch.int64, 624),
                ("rng/torch_cpu", torch.uint8, None)]
        want += [(f"rng/{name}/{i}", torch.uint8, None) for name, n in acc.items()
                 for i in range(n)]
        for name, dtype, size in want:
            t = tensors.get(name)
            if t is None:
                bad(f"tensor {name} is missing")
            if t.dtype != dtype or t.dim() != 1 or size not in (None, t.numel()):
                bad(f"tensor {name} is {str(t.dtype).removeprefix('torch.')} "
                    f"{list(t.shape)}, not {str(dtype).removeprefix('torch.')} "
                    f"[{size or 'N'}]")

    @staticmethod
    def decode(meta: dict, tensors: Tensors) -> "RngState":
        """The state ``encode`` wrote; `BadInput` when the manifest or tensors do not hold it."""
        RngState.check(meta, tensors)
        try:
            return RngState._decode(meta, tensors)
        except (LookupError, TypeError, ValueError, ArithmeticError, AttributeError,
                RuntimeError) as e:   # what a generator's setstate raises for a state it refuses
            raise BadInput(f"the bundle's RNG state is incomplete or malformed "
                           f"({type(e).__name__}: {_show(str(e), 80)[1:-1]}); re-capture the "
                           "bundle") from None

    @staticmethod
    def _decode(meta: dict, tensors: Tensors) -> "RngState":
        version, gauss = meta["python"]
        words = tensors["rng/python_words"].tolist()
        kind, pos, has_gauss, cached = meta["numpy"]
        keys = tensors["rng/numpy_keys"].numpy().astype(np.uint32)
        accel = {name: [tensors[f"rng/{name}/{i}"] for i in range(n)]
                 for name, n in meta["accel"].items()}
        state = RngState((version, tuple(words), gauss), (kind, keys, pos, has_gauss, cached),
                         tensors["rng/torch_cpu"], accel)
        # NB: try each state on a private generator, so a malformed one fails here, not in `set`
        random.Random().setstate(state.python)
        np.random.RandomState().set_state(state.numpy)
        torch.Generator().set_state(state.torch_cpu)
        if not all(isinstance(t, torch.Tensor) for ts in accel.values() for t in ts):
            raise TypeError("accelerator RNG states are not tensors")
        if gauss is not None and type(gauss) is not float:
            raise TypeError(f"Python's cached gaussian is {type(gauss).__name__}, not a float")
        return state
