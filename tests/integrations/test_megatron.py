"""megatron-core on CPU ranks: `nanbisect.integrations.megatron.on_cpu` (the pipeline schedule
itself runs on real gloo ranks in tests/multirank/test_pipelined.py)."""
from __future__ import annotations

import pytest
import torch

from nanbisect.integrations.megatron import on_cpu


def test_inside_on_cpu_what_megatron_puts_on_cuda_lands_on_the_cpu_and_outside_nothing_changed():
    before = (torch.cuda.current_device, torch.cuda.synchronize)
    with on_cpu():
        # as megatron-core 0.16's schedules and p2p communicator make them
        made = [torch.zeros([], dtype=torch.int, device="cuda"),
                torch.empty((3, 2), device=torch.cuda.current_device()),
                torch.ones(2, device=torch.device("cuda", 0)), torch.full((1,), 2.0, device=0)]
        torch.cuda.synchronize()
        with on_cpu():           # nested: the outer one still holds after the inner ends
            pass
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    assert {t.device.type for t in made} == {"cpu"}
    assert (torch.cuda.current_device, torch.cuda.synchronize) == before
    with pytest.raises(ValueError), on_cpu():
        raise ValueError("the step failed")
    assert (torch.cuda.current_device, torch.cuda.synchronize) == before
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")
