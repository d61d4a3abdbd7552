"""The process-wide CPU allocator setting: which glibc ``mallopt`` knobs it applies, once.

How many page faults a step then saves depends on the machine and the moment; that
figure belongs to the benchmarks (benchmarks/bench_local.py), not to a test.
"""

from __future__ import annotations

import ctypes
import platform

import pytest

from gpipe_lab.pipeline import retain_freed_memory
from gpipe_lab.pipeline.devices import allocator


class FakeLibc:
    """Stands for glibc: records ``mallopt`` calls, accepts or refuses them."""

    def __init__(self, accept: bool = True, glibc: bool = True) -> None:
        self.calls: list[tuple[int, int]] = []
        self._accept = accept
        if glibc:
            self.gnu_get_libc_version = lambda: b"2.99"
        outer = self

        class Mallopt:
            argtypes: list = []
            restype = None

            def __call__(self, param: int, value: int) -> int:
                outer.calls.append((param, value))
                return 1 if outer._accept else 0

        self.mallopt = Mallopt()


@pytest.fixture
def fake_libc(monkeypatch: pytest.MonkeyPatch):
    def install(**kwargs) -> FakeLibc:
        libc = FakeLibc(**kwargs)
        monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: libc)
        monkeypatch.setattr(allocator.sys, "platform", "linux")
        return libc
    return install


def test_the_three_mallopt_settings_are_applied(fake_libc) -> None:
    libc = fake_libc()
    assert allocator._apply() is True
    assert libc.calls == [(-3, 32 << 20), (-2, 64 << 20), (-1, 2**31 - 1)]
    assert libc.mallopt.argtypes == [ctypes.c_int, ctypes.c_int]


def test_a_refused_setting_or_another_libc_reports_false(fake_libc) -> None:
    refused = fake_libc(accept=False)
    assert allocator._apply() is False
    assert len(refused.calls) == 3  # every knob is still tried
    musl = fake_libc(glibc=False)
    assert allocator._apply() is False
    assert musl.calls == []


def test_retain_freed_memory_is_idempotent_and_takes_effect_on_glibc() -> None:
    first = retain_freed_memory()
    assert retain_freed_memory() is first
    if platform.libc_ver()[0] == "glibc":
        assert first is True  # the real glibc accepted every setting
