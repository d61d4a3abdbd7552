"""The engine's process-wide CPU allocator setting and its cheap non-finite check."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from gpipe_lab.pipeline import all_finite, retain_freed_memory

# A "step" in a fresh worker thread, as the local transport runs one: 40 MiB of
# activations, every page touched, then freed. Prints the page faults of 8 steps.
_STEPS = textwrap.dedent("""
    import resource, sys, threading, time, torch
    if sys.argv[1] == "retain":
        from gpipe_lab.pipeline import retain_freed_memory
        assert retain_freed_memory()
    def step():
        xs = [torch.ones(256, 1024) for _ in range(40)]
        del xs
    faults = []
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = threading.Thread(target=step)
        t.start()
        t.join()
        time.sleep(0.05)  # join returns before the OS thread hands its malloc arena back
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(faults)
""")


def _faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return [int(v) for v in out.strip().strip("[]").split(",")]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_retained_memory_is_reused_without_page_faults() -> None:
    default, retained = _faults("default"), _faults("retain")
    pages = 40 * (1 << 20) // 4096
    # glibc's defaults give the freed heap back: every step faults its 40 MiB in again
    assert min(default[2:]) > pages // 2, default
    # retained: later steps reuse the pages already mapped (the thread heap is kept)
    assert max(retained[2:]) < pages // 20, retained


def test_retain_freed_memory_is_idempotent() -> None:
    first = retain_freed_memory()
    assert retain_freed_memory() is first
    if sys.platform.startswith("linux"):
        assert first is True


def test_all_finite_detects_nan_and_inf() -> None:
    ok = torch.ones(1000)
    assert all_finite([ok, None, torch.zeros(3)])
    assert all_finite([])
    nan = torch.ones(10)
    nan[3] = float("nan")
    assert not all_finite([ok, nan])
    assert not all_finite([torch.tensor([float("inf"), -float("inf")])])  # the sum is nan
    assert not all_finite([torch.tensor([1.0, -float("inf")])])


def test_all_finite_is_not_fooled_by_a_sum_that_overflows() -> None:
    huge = torch.full((4,), 3e38)  # finite elements, infinite sum
    assert all_finite([huge])
    assert all_finite([torch.full((100_000,), 60000.0, dtype=torch.float16)])
    half = torch.ones(8, dtype=torch.bfloat16)
    half[0] = float("nan")
    assert not all_finite([half])
