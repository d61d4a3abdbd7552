"""Keep freed CPU memory in the process between pipeline steps (glibc only).

PyTorch's CPU tensors come straight from ``malloc``. With glibc's defaults a
step's activations (megabytes each) are handed back to the kernel when they
are freed, so the next step page-faults them in again; worker threads are hit
hardest, because an empty per-thread heap is unmapped as a whole. Every step
then pays page faults for its activations, and its element-wise kernels run
on cold memory, slower than on memory the process kept.

``retain_freed_memory`` sets, once per process, the three ``mallopt`` knobs
that stop this: large blocks come from the heap instead of private mappings,
the heap is not trimmed, and a thread heap keeps a pad instead of being
unmapped. Freed memory is then reused by the next step (resident memory stays
at the step's peak, as with CUDA's caching allocator). Elsewhere than glibc it
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value: blocks below it come from the heap
_TOP_PAD = 64 << 20  # a thread heap (64 MiB) that empties keeps this much instead of being unmapped
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest, i.e. trim only beyond 2 GiB free

_lock = threading.Lock()
_state: dict[str, bool] = {}


def retain_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse; returns whether the settings are in effect.

    Idempotent and thread-safe; a no-op returning ``False`` where the C library
    is not glibc (macOS, Windows, musl) or refuses a setting.
    """
    with _lock:
        if "applied" not in _state:
            _state["applied"] = _apply()
        return _state["applied"]


def _apply() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError outside glibc
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok: bool = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TOP_PAD, _TOP_PAD) == 1 and ok
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    return ok
