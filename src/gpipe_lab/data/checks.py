"""Argument checks shared by the datamodules: one clear error per bad value."""

from __future__ import annotations

from pathlib import Path


def check_positive_int(key: str, value: object, *, minimum: int = 1) -> int:
    """Return ``value`` as an int after checking ``value >= minimum``.

    Raises:
        ValueError: if ``value`` is not an integer (bools excluded) or is below ``minimum``;
            the message names ``key`` and the allowed range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value}")
    return value


def check_fraction(key: str, value: float, *, low: float = 0.0, high: float = 1.0) -> float:
    """Return ``value`` after checking ``low <= value <= high``.

    Raises:
        ValueError: if ``value`` lies outside ``[low, high]``; the message names ``key``.
    """
    if not low <= float(value) <= high:
        raise ValueError(f"{key} must be in [{low}, {high}], got {value!r}")
    return float(value)


def check_replica(rank: int, size: int) -> tuple[int, int]:
    """Validate a data-parallel replica index and count.

    Raises:
        ValueError: if ``data_parallel_size < 1`` or ``data_parallel_rank`` is not in
            ``[0, data_parallel_size - 1]``.
    """
    check_positive_int("data_parallel_size", size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"data_parallel_rank must be an integer in [0, {size - 1}], got {rank!r}")
    return rank, size


class DataNotFoundError(FileNotFoundError):
    """A dataset's files are missing or damaged; the message says where and how to provide them
    (``gpipe-train`` prints it as one line, without a traceback)."""


def require_path(path: str | Path, what: str, hint: str) -> Path:
    """Return ``path`` as a Path if it exists.

    Raises:
        DataNotFoundError: (a ``FileNotFoundError``) naming the missing path, what was expected there, and ``hint``
            (how to provide it, e.g. ``data.root=/path/to/data``).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise DataNotFoundError(f"{what} not found at '{path}'. {hint}")
    return path
