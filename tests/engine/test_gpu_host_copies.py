"""Copies to the CPU are blocking (a non-blocking GPU-to-CPU copy can be read before it lands).

A ``meta`` tensor stands in for a GPU one: it is on another device than the CPU,
so every path below really copies, and a spy on ``Tensor.to`` sees how.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpipe_lab.pipeline.devices.assignment import move_target, to_device
from gpipe_lab.pipeline.microbatch import to_device as tuple_to_device
from gpipe_lab.pipeline.step.nonfinite import nonfinite_flag, verdict_vector

CPU = torch.device("cpu")


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, bool]]:
    """(from, to, non_blocking) of every copy; a meta tensor's copy comes back as CPU zeros."""
    seen: list[tuple[str, str, bool]] = []
    original = torch.Tensor.to

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (str, torch.device)):
            seen.append(
                (self.device.type, torch.device(target).type, bool(kwargs.get("non_blocking", False)))
            )
            if self.is_meta:
                return torch.zeros(self.shape, dtype=self.dtype, device=target)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    return seen


def test_placement_copies_to_the_cpu_are_blocking(copies: list[tuple[str, str, bool]]) -> None:
    to_device(torch.ones(2, device="meta"), CPU)
    move_target({"y": [torch.ones(2, device="meta")]}, CPU)
    tuple_to_device((torch.ones(2, device="meta"), torch.ones(1)), CPU)
    assert copies == [("meta", "cpu", False)] * 3


def test_nonfinite_flags_reach_a_cpu_device_by_blocking_copies(copies: list[tuple[str, str, bool]]) -> None:
    flag = nonfinite_flag([torch.ones(2), torch.ones(3, device="meta")])
    assert flag is not None and not bool(flag)
    assert copies == [("meta", "cpu", False)]
    module = torch.nn.Linear(2, 2, device="meta")
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    copies.clear()
    verdict_vector(None, {0: module}, 1, 1, check=True, device=CPU)
    assert copies and all(dst != "cpu" or not non_blocking for _, dst, non_blocking in copies)
