"""``torch.npu``: the emulated device's module (what ``torch_npu`` registers under that name)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from torch_npu import _C

NAME = "Emulated NPU (host memory, CPU kernels)"


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return int(_C.DEVICES)


def current_device() -> int:
    return int(_C.current_device())


def set_device(device: Any) -> None:
    _C.set_device(_index(device))


def get_device_name(device: Any = None) -> str:
    _index(device)
    return NAME


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


def synchronize(device: Any = None) -> None:
    """Everything has completed already; counted (`synchronizations`), so a test can see how
    often a caller waited for the device."""
    _C.synchronize()


def synchronizations() -> int:
    """How many times this process waited for the device: synchronize (of the module, a stream
    or the device guard), a value read (``.item()``), a blocking copy to the host."""
    return int(_C.synchronizations())


def _index(device: Any) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        idx = device
    else:
        d = torch.device(device)
        if d.type != "npu":
            raise ValueError(f"not an npu device: {device}")
        idx = current_device() if d.index is None else d.index
    if not 0 <= idx < device_count():
        raise RuntimeError(f"npu: device index {idx} out of range ({device_count()} devices)")
    return idx


# -- RNG ------------------------------------------------------------------------------------
def manual_seed(seed: int) -> None:
    _C.manual_seed(current_device(), int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _C.manual_seed(i, int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def seed() -> None:
    _C.seed(current_device())


def seed_all() -> None:
    for i in range(device_count()):
        _C.seed(i)


def initial_seed() -> int:
    return int(_C.initial_seed(current_device()))


def get_rng_state(device: Any = None) -> torch.Tensor:
    return _C.get_rng_state(_index(device))


def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
    _C.set_rng_state(_index(device), state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(states: list[torch.Tensor]) -> None:
    for i, s in enumerate(states):
        set_rng_state(s, i)


def default_generator(device: Any = None) -> torch.Generator:
    return _C.default_generator(_index(device))


# -- streams and events: one stream per device, on which everything has completed ----------
class Stream(torch.Stream):
    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any):
        return super().__new__(cls, device=torch.device("npu", _index(device)), priority=priority)


class Event(torch.Event):
    def __new__(cls, enable_timing: bool = False, **kwargs: Any):
        return super().__new__(cls, device="npu", enable_timing=enable_timing)


def current_stream(device: Any = None) -> Stream:
    return Stream(device)


def default_stream(device: Any = None) -> Stream:
    return Stream(device)


@contextmanager
def stream(s: Any) -> Iterator[Any]:
    yield s


@contextmanager
def device(d: Any) -> Iterator[None]:
    old = current_device()
    set_device(d)
    try:
        yield
    finally:
        set_device(old)
