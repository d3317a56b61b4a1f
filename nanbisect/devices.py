"""The device seam: everything nanbisect does differently per device type, in one registry.

Each device type (``cpu``, ``cuda``, ``npu`` through ``torch_npu``, ``xpu``, ``mps``; torch's
shape-only ``meta``) is one `DeviceType` entry: how a device string of that type is parsed
and validated, the extension to import first, its RNG's get/set, its streams and events (the
Guard's side-stream snapshot), the collective backend a multi-rank replay uses on it, the
device a local rank takes, whether a repro of a built-in op may run in a fork of this process,
whether its tensors hold values, and a fingerprint of the hardware and libraries for the
manifest. The rest of nanbisect asks the entry of a device's type (`entry`) and never names a
device type itself, so adding a backend is one `register` call:

>>> class Mine(DeviceType):
...     name, backend = "mine", "gloo"
>>> with registered(Mine()):
...     entry(torch.device("cpu")).name, "mine" in TYPES
('cpu', True)

Guarantees: importing this module imports torch and nothing of nanbisect but its errors; a
device type whose extension is missing or whose runtime is broken is simply not available
(never an exception from `available`). Not guaranteed: that an entry's ``fingerprint`` knows
every library of a vendor stack (unknown values are left out, never guessed).
"""
from __future__ import annotations

import os
import platform
import re
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from nanbisect.errors import BadInput
from nanbisect.util import torch_internals
from nanbisect.util.spec import DeviceSpec


class DeviceType:
    """One device type's entry. Subclass it (override what differs) and `register` it."""

    name = "cpu"
    extension: str | None = None   # imported before the type is used ("torch_npu")
    backend = "gloo"               # torch.distributed backend of a multi-rank replay on it
    forkable = False               # a repro may run in a fork of this process (CPU only)
    # the ranks of a multi-rank replay may be forked from one interpreter that imported torch
    # but used no device (`nanbisect.multirank.spawn`); else each rank is a fresh interpreter.
    # Off for accelerators until checked on one: a driver initialised before the fork (even by
    # an `is_available()` at import) is not usable in the child.
    fork_ranks = False
    # the host reads this type's tensors in place, without a copy or a synchronisation (the
    # CPU): its copies kept "off the device" are plain clones, its state is already on the host
    host_reads_free = False
    # host copies of its tensors may be page-locked (``pin_memory``) and filled asynchronously
    # (``non_blocking``), complete at `synchronize`
    pinned_host_memory = False
    # its tensors hold values (not torch's ``meta``: a shape and a dtype only, nothing to read,
    # no generator, no storage to alias)
    holds_values = True

    # -- the runtime -----------------------------------------------------------------------
    def module(self) -> Any:
        """``torch.<name>`` (torch.cuda, torch.npu, ...), the extension imported first."""
        if self.extension:
            try:
                __import__(self.extension)
            except Exception:  # noqa: BLE001 - missing or broken (a vendor library absent):
                return None    # the type is not available here
        return getattr(torch, self.name, None)

    def available(self) -> bool:
        mod = self.module()
        try:
            return bool(mod is not None and hasattr(mod, "is_available") and mod.is_available())
        except Exception:  # noqa: BLE001 - a broken runtime is an absent one
            return False

    def count(self) -> int:
        mod = self.module()
        return int(mod.device_count()) if hasattr(mod, "device_count") else 1

    def validate(self, device: torch.device, spec: str, flag: str) -> None:
        """`BadInput` when ``device`` cannot be used on this machine."""
        ok = self.available()
        if ok and device.index is not None:
            ok = device.index < self.count()
        if not ok:
            raise BadInput(f"device '{spec}' is not available on this machine; pass {flag} "
                           "with a device it has (cpu always works)")

    def local(self, local_rank: int) -> torch.device:
        """The device a rank with this ``LOCAL_RANK`` replays on."""
        return torch.device(self.name, local_rank)

    def synchronize(self) -> None:
        """Wait for what this type's current device has queued (its asynchronous copies)."""
        mod = self.module()
        if hasattr(mod, "synchronize"):
            mod.synchronize()

    # -- RNG ---------------------------------------------------------------------------------
    def get_rng(self) -> list[torch.Tensor]:
        """Every device's generator state, in device order."""
        mod = self.module()
        return mod.get_rng_state_all() if hasattr(mod, "get_rng_state_all") \
            else [mod.get_rng_state()]

    def set_rng(self, states: list[torch.Tensor]) -> None:
        mod = self.module()
        if hasattr(mod, "set_rng_state_all") and len(states) == self.count():
            mod.set_rng_state_all(states)
        else:
            mod.set_rng_state(states[0])

    def get_device_rng(self, device: torch.device) -> torch.Tensor | None:
        """The generator state of one device (a caught op's); None when the type has none."""
        mod = self.module()
        return mod.get_rng_state(device) if hasattr(mod, "get_rng_state") else None

    # -- streams and events (the Guard's side-stream snapshot) -------------------------------
    def streams(self) -> Any:
        """The module with ``Stream``/``stream``/``current_stream`` (None: no streams)."""
        mod = self.module()
        ok = mod is not None and all(hasattr(mod, a) for a in
                                     ("Stream", "stream", "current_stream"))
        return mod if ok else None

    def has_streams(self) -> bool:
        return self.streams() is not None

    def new_stream(self, device: torch.device) -> Any:
        return self.streams().Stream(device=device)

    def side_copy(self, stream: Any, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Any:
        """Copy ``src`` into ``dst`` on ``stream`` after what the current stream has queued;
        returns the event reached when the copies are complete (`wait_event`)."""
        mod = self.streams()
        stream.wait_stream(mod.current_stream(stream.device))  # what the last step wrote, first
        with mod.stream(stream):
            torch_internals.foreach_copy_(dst, src)
        for t in src:     # memory freed meanwhile (by code other than the optimizer) is not
            t.record_stream(stream)     # reused before the copy has read it
        return stream.record_event()

    def wait_event(self, device: torch.device, event: Any) -> None:
        """Make ``device``'s current stream wait for ``event``."""
        self.streams().current_stream(device).wait_event(event)

    # -- fingerprint -------------------------------------------------------------------------
    def environment(self) -> dict:
        """Keys this type adds to a ticket pack's environment summary (`environment`)."""
        return {}

    def fingerprint(self) -> dict:
        """What identifies this type's hardware and libraries here (JSON values only)."""
        mod = self.module()
        out: dict = {}
        try:
            out["devices"] = [mod.get_device_name(i) for i in range(self.count())]
        except Exception:  # noqa: BLE001 - a runtime without names: leave it out
            pass
        return out


class Cpu(DeviceType):
    name = "cpu"
    forkable = True
    fork_ranks = True
    host_reads_free = True

    def synchronize(self) -> None:
        pass

    def module(self) -> Any:
        return torch.cpu

    def available(self) -> bool:
        return True

    def count(self) -> int:
        return 1

    def validate(self, device: torch.device, spec: str, flag: str) -> None:
        pass

    def local(self, local_rank: int) -> torch.device:
        return torch.device("cpu")     # every rank shares the host

    def get_rng(self) -> list[torch.Tensor]:
        return [torch.get_rng_state()]

    def set_rng(self, states: list[torch.Tensor]) -> None:
        torch.set_rng_state(states[0])

    def get_device_rng(self, device: torch.device) -> torch.Tensor | None:
        return torch.get_rng_state()

    def streams(self) -> Any:
        return None

    def fingerprint(self) -> dict:
        """The CPU's model and vendor, the instruction set ATen's kernels use
        (``ATEN_CPU_CAPABILITY`` can lower it) and the BLAS and oneDNN torch was built with."""
        out = {"machine": platform.machine(), "processor": _cpuinfo("model name")
               or platform.processor()}
        vendor = _cpuinfo("vendor_id")
        if vendor:
            out["vendor"] = vendor
        try:
            out["capability"] = torch.backends.cpu.get_cpu_capability()
        except Exception:  # noqa: BLE001 - older torch
            pass
        out.update(_cpu_libraries())
        return out


class Cuda(DeviceType):
    name = "cuda"
    backend = "nccl"
    pinned_host_memory = True

    def environment(self) -> dict:
        """What a ticket pack has always said of CUDA: whether it is available, the CUDA torch
        was built with and, when available, the GPUs' names, cuDNN and the driver."""
        env: dict = {"cuda_available": torch.cuda.is_available(),
                     "torch_cuda": torch.version.cuda}
        if not env["cuda_available"]:
            return env
        env["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cudnn"] = torch.backends.cudnn.version()
        try:
            env["driver"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") \
                else None
        except Exception:  # noqa: BLE001 - absent on some builds
            env["driver"] = None
        return env

    def fingerprint(self) -> dict:
        """Per GPU its name, compute capability and memory (lists in device order); the driver,
        CUDA (or HIP), cuDNN and NCCL versions."""
        out = super().fingerprint()
        for key, value in (("cuda", torch.version.cuda),
                           ("hip", getattr(torch.version, "hip", None)),
                           ("driver", _nvidia_driver())):
            if value:
                out[key] = str(value)
        try:
            props = [torch.cuda.get_device_properties(i) for i in range(self.count())]
            out["capability"] = [[p.major, p.minor] for p in props]
            out["memory"] = [int(p.total_memory) for p in props]
            out["cudnn"] = torch.backends.cudnn.version()
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - partial stacks: what is known is kept
            pass
        return out


class Npu(DeviceType):
    name = "npu"
    extension = "torch_npu"
    backend = "hccl"
    pinned_host_memory = True

    def fingerprint(self) -> dict:
        """Per NPU its name; the torch_npu and CANN versions where the extension says them."""
        out = super().fingerprint()
        try:
            import torch_npu

            out["torch_npu"] = str(torch_npu.__version__)
        except Exception:  # noqa: BLE001 - no extension: nothing to say
            pass
        cann = getattr(torch.version, "cann", None)     # set by torch_npu where it knows it
        if isinstance(cann, str) and cann:
            out["cann"] = cann
        return out


class Xpu(DeviceType):
    name = "xpu"
    backend = "xccl"


class Mps(DeviceType):
    name = "mps"

    def count(self) -> int:
        return 1

    def local(self, local_rank: int) -> torch.device:
        return torch.device("mps")


class Meta(DeviceType):
    """torch's ``meta`` device: tensors of a shape and a dtype without values (shape checks).
    Never available as a target: nothing on it can be replayed."""
    name = "meta"
    holds_values = False


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` of /proc/cpuinfo (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return None


def _cpu_libraries() -> dict:
    """The BLAS and oneDNN torch was built with, from its build configuration (only what it
    names: an OpenBLAS build names no version)."""
    try:
        config = torch.__config__.show()
    except Exception:  # noqa: BLE001 - a build without it: nothing to say
        return {}
    out = {}
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    mkl = re.search(r"Math Kernel Library Version (\S+)", config)
    if blas or mkl:
        out["blas"] = " ".join(x for x in (blas and blas.group(1), mkl and mkl.group(1)) if x)
    dnn = re.search(r"(?:MKL-DNN|oneDNN) v(\S+)", config)
    if dnn:
        out["onednn"] = dnn.group(1)
    return out


def _nvidia_driver() -> str | None:
    """The NVIDIA kernel driver's version (Linux), or None."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", f.read())
    except OSError:
        return None
    return found.group(1) if found else None


TYPES: dict[str, DeviceType] = {}
HOST = torch.device("cpu")      # where host copies live (what Python and files read)
SHAPES = torch.device("meta")   # where a tensor of a shape and a dtype without values lives


def register(dt: DeviceType) -> DeviceType:
    """Add (or replace) the entry of ``dt.name``; returns what it replaced (or ``dt``)."""
    old = TYPES.get(dt.name, dt)
    TYPES[dt.name] = dt
    return old


@contextmanager
def registered(dt: DeviceType) -> Iterator[DeviceType]:
    """``dt`` registered for the block, the entry it replaced (if any) restored after."""
    old = TYPES.get(dt.name)
    TYPES[dt.name] = dt
    try:
        yield dt
    finally:
        if old is None:
            TYPES.pop(dt.name, None)
        else:
            TYPES[dt.name] = old


for _dt in (Cpu(), Cuda(), Npu(), Xpu(), Mps(), Meta()):
    register(_dt)


def entry(device: torch.device | str) -> DeviceType:
    """The entry of ``device``'s type (a plain `DeviceType` for a type nobody registered)."""
    name = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    found = TYPES.get(name)
    if found is None:
        found = DeviceType()
        found.name = name
    return found


def resolve(spec: DeviceSpec, flag: str = "--target/--reference"
            ) -> tuple[torch.device, torch.dtype | None]:
    """A device spec as torch's: ``cuda:1`` -> (device, None); ``cpu:float64`` -> (cpu,
    torch.float64); ``cuda:1:float64`` -> (cuda:1, torch.float64); the device validated by its
    entry (`BadInput` naming ``flag`` when this machine lacks it). ``none`` is no device here: a
    caller that accepts it asks ``spec.none`` first. The one place a spec meets torch.

    >>> resolve(DeviceSpec("cpu", "float64")), resolve(DeviceSpec("cpu"))
    ((device(type='cpu'), torch.float64), (device(type='cpu'), None))
    """
    text = str(spec)
    dtype = None
    if spec.dtype is not None:
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise BadInput(f"device '{text}': '{spec.dtype}' is not a floating dtype; use e.g. "
                           "cpu:float64")
    if not spec.none:    # an extension's type ("npu") exists only once the extension is imported
        entry(spec.type).module()
    try:
        device = torch.device(text if spec.none else spec.device)
    except RuntimeError:
        raise BadInput(f"device '{text}' is not a torch device string; use e.g. cpu, cuda, "
                       "cuda:1") from None
    entry(device).validate(device, text, flag)
    return device, dtype


def parse(text: str, flag: str = "--target/--reference"
          ) -> tuple[torch.device, torch.dtype | None]:
    """`resolve` of a device string that arrives as text over a process boundary (a child's
    argument list: a rank worker's ``--target``, the compiler child's ``--device``); its form
    checked first (`DeviceSpec.parse`).

    >>> parse("cpu:float64")
    (device(type='cpu'), torch.float64)
    """
    return resolve(DeviceSpec.parse(text), flag)


def default_reference(target: torch.device) -> DeviceSpec:
    """The reference a run uses without ``--reference``: the CPU for an accelerator target,
    none (``DeviceSpec(None)``) for a CPU one (a CPU replayed against itself proves nothing).

    >>> default_reference(HOST)
    DeviceSpec(device=None, dtype=None)
    """
    return DeviceSpec(HOST.type) if not on_host(target) else DeviceSpec(None)


def present(text: str) -> DeviceSpec | None:
    """The device ``text`` names (a manifest's ``captured_on``) as a spec when this machine has
    it; None otherwise (another machine's device, or not a device string).

    >>> present("cpu"), present("gpu9:x")
    (DeviceSpec(device='cpu', dtype=None), None)
    """
    try:
        spec = DeviceSpec.parse(text)
        resolve(spec)
    except BadInput:
        return None
    return spec


def on_host(device: torch.device | str) -> bool:
    """Whether ``device``'s type is the host's (its tensors read in place: `host_reads_free`).

    >>> on_host("cpu"), on_host(torch.device("meta"))
    (True, False)
    """
    return entry(device).host_reads_free


def holds_values(device: torch.device | str) -> bool:
    """Whether ``device``'s tensors hold values to read (`DeviceType.holds_values`; not the
    ``meta`` device's, `SHAPES`).

    >>> holds_values("cpu"), holds_values(SHAPES)
    (True, False)
    """
    return entry(device).holds_values


def local_device(spec: str) -> tuple[torch.device, torch.dtype | None]:
    """`parse`, with an accelerator's device taken from ``LOCAL_RANK`` (a rank worker)."""
    device, dtype = parse(spec)
    if not on_host(device):
        device = entry(device).local(int(os.environ.get("LOCAL_RANK", 0)))
    return device, dtype


def accelerators() -> list[str]:
    """Registered types other than the CPU that are available here (their RNG is captured)."""
    return [name for name, dt in TYPES.items() if not dt.host_reads_free and dt.available()]


def collective_device(backend: str, device: torch.device | None = None) -> torch.device:
    """Where the tensors of a collective on a process group of ``backend`` live: the host for
    gloo; else ``device`` when given (the model's); else the device of the available type whose
    backend ``backend`` names (``nccl``, ``cpu:gloo,cuda:nccl``: cuda); else the host.

    >>> collective_device("gloo", torch.device("meta")), collective_device("mine")
    (device(type='cpu'), device(type='cpu'))
    """
    if backend == "gloo":
        return HOST
    if device is not None:
        return device
    named = set(re.split(r"[,:]", backend))
    for name, dt in TYPES.items():
        if not dt.host_reads_free and dt.backend in named and dt.available():
            return torch.device(name)
    return HOST


def environment() -> dict:
    """Each registered type's keys for a ticket pack's environment summary (`DeviceType.
    environment`: CUDA's, kept as packs have always said them)."""
    out: dict = {}
    for dt in TYPES.values():
        out.update(dt.environment())
    return out


def collective_backend(placed: list[torch.device]) -> str | None:
    """The process group's backend for the devices of both sides of a multi-rank replay: the
    one type's backend (``gloo`` for CPU, ``nccl`` for CUDA, ``hccl`` for NPU), or both at once
    (``cpu:gloo,cuda:nccl``) for an accelerator target with a CPU reference or the reverse;
    None (torch's default for the devices) otherwise.

    >>> collective_backend([HOST, HOST])
    'gloo'
    """
    types = sorted({d.type for d in placed}, key=lambda t: not on_host(t))
    if len(types) == 1:
        return entry(types[0]).backend
    if len(types) == 2 and on_host(types[0]):
        return ",".join(f"{t}:{entry(t).backend}" for t in types)
    return None


def fingerprint() -> dict:
    """The hardware and library fingerprint of this machine: the CPU's, and each available
    accelerator type's (`DeviceType.fingerprint`)."""
    out = {HOST.type: entry(HOST).fingerprint()}
    for name in accelerators():
        out[name] = TYPES[name].fingerprint()
    return out
