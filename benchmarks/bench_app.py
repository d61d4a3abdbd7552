"""The app rows of ``benchmarks.run``: ``gpipe-train``'s step against the raw engine's, and compiled stages.

Each row runs in its own process (``bench_product_path`` / ``bench_compile``): Lightning's
multi-process launch re-executes its command, and a fresh process keeps one row's
compiled kernels and allocator state out of the next. A row that fails keeps its error
and the rest still run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.bench_compile import K as COMPILE_K

ROOT = Path(__file__).resolve().parent.parent
#: (model, transport) of the product-path rows: both analogues locally, the Transformer over gloo too.
PRODUCT_CASES = (("transformer", "local"), ("amoebanet", "local"), ("transformer", "distributed"))


def _run(args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[str, str | None]:
    """(stdout, error or None) of ``python -m <args>`` from the repository root, with ``env`` added
    to the environment; on timeout the whole process group goes (Lightning's rank processes,
    Inductor's compile workers)."""
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return out, f"timed out after {timeout:.0f} s"  # what it printed so far still counts
    if proc.returncode != 0:
        return out, f"exit {proc.returncode}: {err.strip().splitlines()[-1:] or ['']}"
    return out, None


def command_of(args: list[str]) -> str:
    return "python -m " + " ".join(args)


def run_product_rows(quick: bool, repeats: int, timeout: float = 1800, warmup: int | None = None,
                     layers: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
    """One row per ``PRODUCT_CASES`` entry: product and raw step medians, their ratio, the command.

    ``layers``: ``model.num_layers`` per model (the config's mini-batch kept); ``warmup``: untimed
    rounds (default: the script's).
    """
    rows = []
    for model, transport in PRODUCT_CASES:
        args = ["benchmarks.bench_product_path", "--model", model, "--transport", transport,
                "--repeats", str(repeats)] + (["--quick"] if quick else [])
        if layers and model in layers:
            args += ["--layers", str(layers[model])]
        if warmup is not None:
            args += ["--warmup", str(warmup)]
        print(f"[product] {model} {transport} ...", flush=True)
        out, error = _run(args, timeout)
        found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        row: dict[str, Any] = found[-1] if found and error is None else {
            "model": model, "transport": transport, "error": error or "no result printed"}
        rows.append({**row, "command": command_of(args)})
    return rows


def run_compile_rows(quick: bool, chunks: tuple[int, ...], repeats: int,
                     timeout: float = 1800) -> list[dict[str, Any]]:
    """Eager vs compiled step and compile seconds per (analogue, M) (``bench_compile``), each in its
    own process with an empty Inductor cache and ``timeout`` seconds, so every compile time is a cold
    compile and one slow compile does not take the next M's row with it; a process that fails or
    times out gives a row with its model, K, M and error."""
    rows = []
    for model in ("transformer", "amoebanet"):
        for m in chunks:
            args = ["benchmarks.bench_compile", "--models", model, "--chunks", str(m),
                    "--repeats", str(repeats)] + (["--quick"] if quick else [])
            print(f"[compile] {model} M={m} ...", flush=True)
            with tempfile.TemporaryDirectory() as cache:  # a cold compile: no kernels from an earlier run
                out, error = _run(args, timeout, env={"TORCHINDUCTOR_CACHE_DIR": cache})
            found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            rows += [{**r, "command": command_of(args)} for r in found]
            if error is not None or not found:
                rows.append({"model": model, "K": COMPILE_K, "M": m, "error": error or "no rows",
                             "command": command_of(args)})
    return rows
