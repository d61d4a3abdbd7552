"""How the suite is spread over xdist workers (``python -m pytest -q -n auto``, ``--dist loadgroup``).

- Tests that share a module- or session-scoped fixture of this suite (a training run, a
  launch of gloo processes) run on one worker, so the fixture is built once, not once per
  worker. A test that reaches such a fixture another way (``request.getfixturevalue``, a
  ``functools.cache``) says so with ``pytest.mark.xdist_group``.
- Tests marked ``slow`` start first: the long ones are spread over both workers while
  there is other work for the other worker, and the run ends on short tests.

Without ``-n`` none of this changes what runs; only the order.
- One intra-op thread per process, waiting passively (``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY``,
  unless set): see below.
"""

from __future__ import annotations

import os

# Two workers share two cores: one intra-op thread each (as the docs' commands run), and an OpenMP
# thread that waits sleeps instead of spinning on the core the other worker needs. Read when torch
# loads its OpenMP runtime, so before any test imports it; a test that needs more threads sets them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The suite's own module/session fixtures that ``item`` uses (not pytest's, like tmp_path_factory)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    names = []
    for name, defs in info.name2fixturedefs.items():
        if name in info.names_closure and any(d.scope in ("module", "session") and d.baseid for d in defs):
            names.append(name)
    return sorted(names)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        shared = _shared_fixtures(item)
        if shared and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{'+'.join(shared)}"))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow first, then as collected
