"""Where a result came from: the machine (CPU, GPUs, load), the commit of the code and the command.

Every benchmark report, experiment table and figure records these, so one result can be
told from another made on a busier machine or older code.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from gpipe_lab.bench.provenance import SOURCE_ROOT, commit_of

#: The checkout the scripts run from: ``benchmarks/`` and ``experiments/`` sit beside this package's ``src/``.
ROOT = SOURCE_ROOT


def load_average() -> list[float]:
    """The 1/5/15-minute load averages (empty where the OS has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str) -> dict[str, object]:
    """CPU model, cores, torch version, device and current load (and the GPUs' names on ``cuda``)."""
    info: dict[str, object] = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                               "python": platform.python_version(), "device": device,
                               "load_average": load_average()}
    if device == "cuda" and torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def git_commit() -> str:
    """The checkout's source commit (``gpipe_lab.bench.provenance.commit_of``: ``+dirty`` when tracked files
    outside ``results/`` and Markdown differ from it, so regenerating results does not mark the next
    result dirty; ``unknown`` outside a git checkout)."""
    return commit_of(ROOT)


def command_line(argv: Sequence[str] | None = None) -> str:
    """This process's command (or ``argv``'s), a script of this checkout named as ``python -m`` runs it
    (``python -m experiments.table1_capacity --out x``)."""
    args = list(sys.argv if argv is None else argv) or ["?"]
    path = Path(args[0]).resolve()
    head = [os.path.relpath(args[0]) if args[0] != "?" else "?"]
    if path.suffix == ".py" and path.is_relative_to(ROOT):
        head = ["-m", ".".join(path.relative_to(ROOT).with_suffix("").parts)]
    return f"python {shlex.join(head + args[1:])}"


def figure_metadata() -> dict[str, str]:
    """PNG metadata naming the commit and the command that drew a figure (``fig.savefig(..., metadata=)``)."""
    return {"Source": f"gpipe-lab {git_commit()}", "Description": f"{command_line()} ({time.strftime('%Y-%m-%d %H:%M')})"}


def provenance_meta(argv: Sequence[str] | None = None) -> dict[str, object]:
    """Where a result came from: date, git commit, command, host, CPU model and cores, GPU,
    torch version and the load average when it was written."""
    gpu = torch.cuda.is_available()
    return {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "commit": git_commit(),
            "command": command_line(argv), "host": platform.node(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if gpu else "no GPU", "torch": torch.__version__,
            "load_average": load_average()}


def provenance(argv: Sequence[str] | None = None) -> str:
    """One markdown line of ``provenance_meta``."""
    m = provenance_meta(argv)
    return (f"_Generated {m['date']} at commit `{m['commit']}` on {m['host']} ({m['cpu']}, {m['cores']} CPU cores, "
            f"{m['gpu']}), torch {m['torch']}, load average {m['load_average']}, by `{m['command']}`._")
