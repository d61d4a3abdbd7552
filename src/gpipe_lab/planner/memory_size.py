"""Memory sizes as people write them (``8GiB``, ``512MiB``, ``1.5GB``, ``4096``) and back.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of
1000, as the SI and IEC prefixes say; a bare number is bytes. Units are case-insensitive and may
follow a space (``8 GiB``).
"""

from __future__ import annotations

import math
import re

__all__ = ["UNITS", "format_bytes", "parse_memory"]

UNITS: dict[str, int] = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
ALLOWED = ("a number of bytes, or a number with a unit: KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, "
           "TB (powers of 1000), e.g. 8GiB, 512MiB, 1.5GB")


def parse_memory(value: object, key: str = "memory") -> int:
    """Bytes of a memory size (see the module docstring); ``key`` names the setting in errors.

    Raises:
        ValueError: one line naming ``key``, the value and the allowed forms, for anything else
            (an unknown unit, no number, zero or a negative size, a bool).
    """
    if isinstance(value, bool):
        raise ValueError(f"{key}: {value!r} is not a memory size; allowed: {ALLOWED}")
    if isinstance(value, (int, float)):
        number, unit = float(value), "b"
    else:
        match = _PATTERN.match(str(value))
        if match is None or match.group(2).lower() not in ("", *UNITS):
            raise ValueError(f"{key}: {value!r} is not a memory size; allowed: {ALLOWED}")
        number, unit = float(match.group(1)), (match.group(2).lower() or "b")
    size = number * UNITS[unit]
    if not (math.isfinite(size) and size >= 1):
        raise ValueError(f"{key}: {value!r} must be at least one byte; allowed: {ALLOWED}")
    return int(size)


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``1.50 GiB``, ``312.0 KiB``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.{2 if unit in ('TiB', 'GiB') else 1}f} {unit}"
    return f"{int(n)} B"
