"""Read-only properties that forward to an attribute of an attribute (``self.topo.dp_rank``).

Used where a class exposes another object's fields under its own name (the engine's options,
a rank's topology, the strategy's options), so each forwarding is one line, not a block.
"""

from __future__ import annotations

from operator import attrgetter


def forwarded(path: str, doc: str | None = None) -> property:
    """A read-only property returning ``self.<path>`` (``path`` may be dotted).

    Raises:
        ValueError: ``path`` is empty.
    """
    if not path:
        raise ValueError("forwarded: path must name an attribute, got ''")
    get = attrgetter(path)
    return property(lambda self: get(self), doc=doc or f"``self.{path}`` (read-only).")


__all__ = ["forwarded"]
