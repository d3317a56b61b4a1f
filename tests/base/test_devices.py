"""The device seam (`nanbisect.devices`): one registered entry per device type, and every
device-specific step of capture, replay and op check goes through it.

A CPU-backed test device type is registered in place of the CPU's entry: it counts every call
into the seam, claims streams (so the Guard takes its side-stream snapshot through it) and a
collective backend of its own. A capture -> replay -> op check run then must have used each
entry (parse, RNG, streams, backend, fingerprint); a code path that went around the seam leaves
its count at zero.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nanbisect import Guard, NonFiniteStep, devices
from nanbisect.bundle.format import read_bundle
from nanbisect.errors import BadInput
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.task import import_target
from nanbisect.util.spec import DeviceSpec

TASK = Path(__file__).resolve().parents[1] / "tasks" / "seam_task.py"


class CountingCpu(devices.Cpu):
    """The CPU, seen through the seam: every call counted by the seam entry it is."""

    def __init__(self) -> None:
        self.used: Counter = Counter()

    def validate(self, device, spec, flag):
        self.used["parse"] += 1
        return super().validate(device, spec, flag)

    def get_rng(self):
        self.used["rng"] += 1
        return super().get_rng()

    def set_rng(self, states):
        self.used["rng"] += 1
        return super().set_rng(states)

    def has_streams(self) -> bool:
        return True

    def new_stream(self, device):
        self.used["streams"] += 1
        return SimpleNamespace(device=device)

    def side_copy(self, stream, dst, src):
        self.used["streams"] += 1
        torch._foreach_copy_(dst, src)
        return ("copied", len(dst))

    def wait_event(self, device, event):
        self.used["streams"] += 1
        assert event[0] == "copied"

    @property
    def backend(self) -> str:
        self.used["backend"] += 1
        return "nbtest-gloo"

    def fingerprint(self) -> dict:
        self.used["fingerprint"] += 1
        return {**super().fingerprint(), "test_device": "counting-cpu"}


def test_a_test_device_type_runs_capture_replay_and_op_check_through_the_seam(tmp_path):
    mod = import_target(str(TASK))
    with devices.registered(CountingCpu()) as dt:
        guard = Guard(mod.task(), entry=f"{TASK}:task", out=tmp_path / "bundles", history=0,
                      snapshot="every-step")    # the mode that copies on a side stream
        for i in range(3):
            guard.step(mod.batch(i))
        with pytest.raises(NonFiniteStep) as caught:
            guard.step(mod.batch(3, poison=True))
        bundle = read_bundle(caught.value.bundle)
        captured = dict(dt.used)
        report = run_bundle(bundle.path, RunOptions(reference="cpu", run_repro=False),
                            tmp_path / "report")
        # a rank worker's: its --target and --reference text decoded once, then the backend
        backend = devices.collective_backend(
            [devices.local_device(text)[0] for text in ("cpu", "cpu:float64")])
    # capture: the RNG, the side-stream snapshot and the fingerprint came from the entry
    assert captured.get("rng", 0) >= 1 and captured.get("streams", 0) >= 3, captured
    assert bundle.manifest["environment"]["hardware"]["cpu"]["test_device"] == "counting-cpu"
    # replay and op check: found through the seam's parse and RNG
    assert report.culprit.op == "aten.sqrt.default" and report.culprit.module == "act"
    assert report.op_check is not None and report.op_check.status == "ok"
    assert dt.used["parse"] > captured.get("parse", 0)
    assert dt.used["rng"] > captured["rng"]
    # the rank worker's process group: the entry's backend
    assert backend == "nbtest-gloo"
    assert {"parse", "rng", "streams", "backend", "fingerprint"} <= set(dt.used), dt.used
    # the CPU's own entry is back
    assert type(devices.entry("cpu")) is devices.Cpu


def test_registering_a_type_makes_its_strings_parse_and_its_backend_chosen():
    class Fake(devices.DeviceType):
        name, backend = "privateuseone", "fakeccl"

        def available(self) -> bool:
            return True

        def count(self) -> int:
            return 2

    with pytest.raises(BadInput, match="not available on this machine"):
        devices.parse("privateuseone:0")
    with devices.registered(Fake()):
        assert devices.parse("privateuseone:1")[0] == torch.device("privateuseone", 1)
        with pytest.raises(BadInput, match="not available"):
            devices.parse("privateuseone:2")
        one = torch.device("privateuseone", 1)
        assert devices.collective_backend([one]) == "fakeccl"
        both = devices.collective_backend([one, devices.HOST])
        assert both == "cpu:gloo,privateuseone:fakeccl"
        assert "privateuseone" in devices.accelerators()
        assert devices.default_reference(torch.device("privateuseone", 0)) == DeviceSpec("cpu")
    assert "privateuseone" not in devices.TYPES


def test_parse_refuses_what_is_not_a_device_or_a_floating_dtype():
    assert devices.parse("cpu:float64") == (torch.device("cpu"), torch.float64)
    for bad, why in [("gpu", "not a torch device string"), ("cpu:int32", "not a floating dtype"),
                     ("cuda:7", "not available")]:
        with pytest.raises(BadInput, match=why):
            devices.parse(bad)
    assert devices.default_reference(torch.device("cpu")).none


def test_resolve_takes_a_spec_and_names_the_flag():
    """`devices.resolve`: a parsed spec becomes torch's device and dtype; a device this machine
    lacks is refused naming the flag given; `present` is a manifest's device when it is here."""
    assert devices.resolve(DeviceSpec("cpu", "float64")) == (torch.device("cpu"), torch.float64)
    assert devices.resolve(DeviceSpec("cpu")) == (torch.device("cpu"), None)
    with pytest.raises(BadInput, match="not available on this machine; pass --device"):
        devices.resolve(DeviceSpec("cuda:7"), "--device")
    with pytest.raises(BadInput, match="'none' is not a torch device string"):
        devices.resolve(DeviceSpec("none"))      # a target named none
    assert devices.present("cpu") == DeviceSpec("cpu")
    assert devices.present("cuda:7") is None and devices.present("not a device") is None


def test_the_cpu_fingerprint_names_the_instruction_set_aten_uses():
    """``manifest.environment.hardware.cpu``: what a replay on another CPU is compared by."""
    import platform

    fp = devices.fingerprint()["cpu"]
    assert fp["capability"] == torch.backends.cpu.get_cpu_capability()
    assert fp["machine"] == platform.machine()
    assert all(isinstance(v, str) for v in fp.values()), fp
    if "MKL-DNN v" in torch.__config__.show():        # a build with oneDNN names its version
        assert fp["onednn"][0].isdigit(), fp


def test_a_device_spec_reads_and_writes_a_device_a_dtype_or_none():
    """`DeviceSpec`: ``parse`` and ``str`` are inverse; an index and a dtype together
    (``cpu:0:float64``) resolve; ``none`` is no device (no reference)."""
    for text in ("cpu", "cuda:1", "cpu:float64", "cuda:1:float64", "npu:0:bfloat16", "none"):
        assert str(devices.DeviceSpec.parse(text)) == text
    assert devices.DeviceSpec.parse("none").none and not devices.DeviceSpec.parse("cpu").none
    assert devices.parse("cpu:0:float64") == (torch.device("cpu", 0), torch.float64)
    for bad, why in [("cuda:1:int8", "not a floating dtype"), ("cuda:x:float64", "not a torch"),
                     ("none", "not a torch device string")]:
        with pytest.raises(BadInput, match=why):
            devices.parse(bad)


def test_capabilities_not_names_decide_what_a_device_does():
    """The host reads the CPU's tensors in place; CUDA's host copies are pinned; a backend's
    collectives live where its type does (gloo: the host; a type not available: the host)."""
    assert devices.entry("cpu").host_reads_free and not devices.entry("cuda").host_reads_free
    assert devices.entry("cuda").pinned_host_memory and not devices.entry("cpu").pinned_host_memory
    assert devices.on_host("cpu") and not devices.on_host("meta")
    # a meta tensor has no values to read and is nobody's accelerator (nor a target)
    shapes = torch.empty(0).to("meta").device
    assert devices.holds_values("cuda") and not devices.holds_values(shapes)
    assert "meta" not in devices.accelerators()
    with pytest.raises(BadInput, match="not available"):
        devices.parse("meta")
    meta = torch.device("meta")
    assert devices.collective_device("gloo", meta) == devices.HOST
    assert devices.collective_device("nccl", meta) == meta
    want = torch.device("cuda") if torch.cuda.is_available() else devices.HOST
    assert devices.collective_device("nccl") == want
    assert devices.collective_device("mpi") == devices.HOST
    env = devices.environment()
    assert env["cuda_available"] == torch.cuda.is_available() and "torch_cuda" in env
