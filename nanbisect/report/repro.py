"""The standalone repro: write ``repro/`` from what `locate.catch` caught, run it once.

`write_repro` renders ``repro.py`` from a template and saves the inputs, with the call's non-tensor
arguments as JSON in the safetensors metadata. The repro needs only torch and safetensors.
Complex tensors are saved as their real view (``torch.view_as_real``: safetensors stores no
complex128 nor complex32, and older versions no complex at all), named in the metadata's
``"complex"`` (tensor name -> dtype); the scripts rebuild them with ``torch.view_as_complex``.
`write_module_repro` does the same for a whole module call (it rebuilds the model from the entry,
so it needs that code). Running them once: `nanbisect.report.rerun`.
"""
from __future__ import annotations

import json
import string
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from nanbisect import __version__, devices
from nanbisect.bundle.format import umask_mode
from nanbisect.bundle.state import encode
from nanbisect.options import device_option
from nanbisect.records import Caught, Culprit, ModuleCaught, module_label
from nanbisect.report.rerun import BUILTIN_NAMESPACES
from nanbisect.util.spec import DeviceSpec


def _template(name: str) -> string.Template:
    return string.Template(
        resources.files("nanbisect.report").joinpath(f"templates/{name}").read_text())


def complex_as_real(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Replace each complex tensor of ``tensors`` by its real view (contiguous, last dimension
    2: real and imaginary part); return their names -> complex dtype, for the metadata.

    >>> ts = {"a": torch.tensor([1 + 2j]), "b": torch.ones(1)}
    >>> complex_as_real(ts), ts["a"].tolist()
    ({'a': 'complex64'}, [[1.0, 2.0]])
    """
    kept = {}
    for k, v in tensors.items():
        if v.is_complex():
            kept[k] = str(v.dtype).removeprefix("torch.")
            tensors[k] = torch.view_as_real(v.resolve_conj().resolve_neg()).contiguous()
    return kept


def repro_imports(op: str, entry: str) -> list[str]:
    """Files the repro must import to have ``op``: the entry file, for non-built-in ops.

    >>> repro_imports("aten.sqrt.default", "train.py:task")
    []
    """
    if op.split(".", 1)[0] in BUILTIN_NAMESPACES:
        return []
    target = entry.rpartition(":")[0]
    return [str(Path(target).resolve())] if target.endswith(".py") else []


def target_spec(target: DeviceSpec | str) -> DeviceSpec:
    """A target as a value: a `DeviceSpec` as it is; the text a report records (``DEVICE[:DTYPE]``,
    a rank worker's ``--target``) decoded at this boundary (`nanbisect.options.device_option`).

    >>> target_spec("cuda:1:float64")
    DeviceSpec(device='cuda:1', dtype='float64')
    """
    return target if isinstance(target, DeviceSpec) else device_option(target)


def device_of(target: DeviceSpec | str) -> str:
    """The device of a target (`target_spec`'s device, without the dtype): what a repro's
    ``--device`` takes (its saved inputs already hold the replay's dtype).

    >>> device_of("cpu:float64"), device_of("cuda:1"), device_of(DeviceSpec("npu"))
    ('cpu', 'cuda:1', 'npu')
    """
    return target_spec(target).device


def extensions(target: DeviceSpec | str) -> dict[str, str]:
    """The plug-in a repro imports before using ``target``'s device type (``{"npu":
    "torch_npu"}``; none for built-in types).

    >>> extensions("npu:0:float32"), extensions("cpu")
    ({'npu': 'torch_npu'}, {})
    """
    kind = target_spec(target).type
    ext = devices.entry(kind).extension
    return {kind: ext} if ext else {}


def write_repro(out: Path, caught: Caught, *, culprit: Culprit, kind: str,
                target: DeviceSpec | str, imports: list[str], role: str = "Culprit") -> Path:
    """Write ``out/repro.py`` and ``out/inputs.safetensors``; return the script's path.
    ``role`` names what the op is in the script's docstring (the culprit, or where it
    surfaced)."""
    target = target_spec(target)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta = {"op": caught.op, "args": encode(caught.args, "args", tensors),
            "kwargs": encode(caught.kwargs, "kwargs", tensors), "mutated": caught.mutated}
    tensors.update({k: v.contiguous() for k, v in caught.rng.items()})
    meta["complex"] = complex_as_real(tensors)
    save_file(tensors, str(out / "inputs.safetensors"), metadata={"nanbisect": json.dumps(meta)})
    umask_mode(out / "inputs.safetensors")     # safetensors writes 0600: a colleague must read it
    text = _template("repro.py.tmpl").substitute(
        version=__version__, role=role, op=caught.op, phase=culprit.phase,
        module=module_label(culprit.module),
        module_call=culprit.module_call, op_index=culprit.op_index, source=culprit.source,
        kind=kind, target=device_of(target), imports=repr(imports),
        extensions=repr(extensions(target)))
    (out / "repro.py").write_text(text)
    return out / "repro.py"


def write_module_repro(out: Path, mc: ModuleCaught, *, culprit: Culprit, kind: str,
                       target: DeviceSpec | str, entry: str, compile: dict | None = None
                       ) -> Path:
    """Write ``out/module_repro.py`` and ``out/module_inputs.safetensors`` (the fallback);
    ``compile``: torch.compile's keyword arguments for a compiler culprit (the script runs the
    call eagerly, then compiled, and reproduces when only the compiled call fails)."""
    target = target_spec(target)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta = {"args": encode(mc.args, "args", tensors), "kwargs": encode(mc.kwargs, "kwargs",
                                                                         tensors),
            "grad_out": (encode(mc.grad_out, "grad_out", tensors) if mc.grad_out is not None
                         else None)}
    tensors.update({f"state/{k}": v.contiguous() for k, v in mc.state.items()})
    tensors.update({k: v.contiguous() for k, v in mc.rng.items()})
    meta["complex"] = complex_as_real(tensors)
    save_file(tensors, str(out / "module_inputs.safetensors"),
              metadata={"nanbisect": json.dumps(meta)})
    umask_mode(out / "module_inputs.safetensors")
    target_file, _, func = entry.rpartition(":")
    text = _template("module_repro.py.tmpl").substitute(
        version=__version__, op=culprit.op, phase=culprit.phase,
        module=module_label(mc.call.module),
        module_call=mc.call.call, kind=kind, target=device_of(target), entry=entry,
        entry_file=repr(str(Path(target_file).resolve())), entry_func=repr(func),
        compile=repr(compile), extensions=repr(extensions(target)))
    (out / "module_repro.py").write_text(text)
    return out / "module_repro.py"
