"""The app rows of ``benchmarks.run``: ``gpipe-train``'s step against the raw engine's, and compiled stages.

Each row runs in its own process (``bench_product_path`` / ``bench_compile``): Lightning's
multi-process launch re-executes its command, and a fresh process keeps one row's
compiled kernels and allocator state out of the next. A row that fails keeps its error
and the rest still run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: (model, transport) of the product-path rows: both analogues locally, the Transformer over gloo too.
PRODUCT_CASES = (("transformer", "local"), ("amoebanet", "local"), ("transformer", "distributed"))


def _run(args: list[str], timeout: float) -> tuple[str, str | None]:
    """(stdout, error or None) of ``python -m <args>`` from the repository root."""
    try:
        proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "", f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        return proc.stdout, f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ['']}"
    return proc.stdout, None


def command_of(args: list[str]) -> str:
    return "python -m " + " ".join(args)


def run_product_rows(quick: bool, repeats: int, timeout: float = 1800) -> list[dict[str, Any]]:
    """One row per ``PRODUCT_CASES`` entry: product and raw step medians, their ratio, the command."""
    rows = []
    for model, transport in PRODUCT_CASES:
        args = ["benchmarks.bench_product_path", "--model", model, "--transport", transport,
                "--repeats", str(repeats)] + (["--quick"] if quick else [])
        print(f"[product] {model} {transport} ...", flush=True)
        out, error = _run(args, timeout)
        found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        row: dict[str, Any] = found[-1] if found and error is None else {
            "model": model, "transport": transport, "error": error or "no result printed"}
        rows.append({**row, "command": command_of(args)})
    return rows


def run_compile_rows(quick: bool, chunks: tuple[int, ...], repeats: int,
                     timeout: float = 7200) -> list[dict[str, Any]]:
    """Eager vs compiled step and compile seconds per (analogue, M) (``bench_compile``)."""
    rows = []
    for model in ("transformer", "amoebanet"):
        with tempfile.TemporaryDirectory() as tmp:
            args = ["benchmarks.bench_compile", "--models", model, "--chunks", *map(str, chunks),
                    "--repeats", str(repeats)] + (["--quick"] if quick else [])
            print(f"[compile] {model} M={list(chunks)} ...", flush=True)
            _, error = _run([*args, "--out", str(Path(tmp) / "rows.json")], timeout)
            found = json.loads((Path(tmp) / "rows.json").read_text()) if error is None else []
        rows += [{**r, "command": command_of(args)} for r in found] or [
            {"model": model, "error": error or "no rows", "command": command_of(args)}]
    return rows
