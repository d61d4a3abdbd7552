"""Shared helpers of the experiment scripts: arguments, configs with overrides, result files, wandb.

Every script takes ``--out DIR`` (where the markdown, JSON and PNG files go;
default a fresh ``logs/experiments/<script>/<date>_<time>/``, so that only
``--out results`` replaces a committed result), ``--tiny`` (a seconds-long smoke run at toy sizes) and
``--wandb`` (also log the table and plots to an offline wandb run under DIR).
Its settings come from Hydra ``experiment=`` configs (``conf/experiment/paper_*.yaml``,
composed with ``gpipe_lab.app.config.experiments.compose_experiment``; the script-only settings are in their
``experiment:`` block); Hydra-style ``key=value`` arguments override them, and
``--tiny`` is a fixed set of such overrides applied first.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.multirun import MultirunError
from gpipe_lab.app.config.experiments import compose_experiment
from gpipe_lab.bench.machine import ROOT, figure_metadata, provenance_meta
from gpipe_lab.bench.script_launch import fresh_out

RESULTS = ROOT / "results"


def parser(description: str, experiments: Sequence[str] = (), multirun: bool = False,
           selectable: bool = True) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with the common ``--out``, ``--tiny`` and ``--wandb`` options.

    With ``experiments`` (the configs the script reads by default) it also takes Hydra
    ``key=value`` overrides and, if ``selectable``, ``--experiment NAME`` (repeatable: only these);
    with ``multirun`` also ``--from-multirun DIR [DIR ...]`` (gpipe-train -m output).
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=fresh_out(ROOT / "logs" / "experiments"),
                   help="output directory (default: a fresh logs/experiments/<script>/<time>/; "
                        "--out results replaces the committed results)")
    p.add_argument("--tiny", action="store_true", help="seconds-long smoke run at toy sizes")
    p.add_argument("--wandb", action="store_true", help="log the table and plots to wandb (offline)")
    if experiments and selectable:
        p.add_argument("--experiment", action="append", choices=list(experiments), metavar="NAME",
                       help=f"experiment config(s) to run (default: {', '.join(experiments)})")
    if experiments:
        p.add_argument("overrides", nargs="*", metavar="key=value",
                       help="Hydra overrides of the experiment config(s), e.g. experiment.steps=1")
    if multirun:
        p.add_argument("--from-multirun", nargs="+", type=Path, metavar="DIR",
                       help="build the table from gpipe-train -m runs under DIR (their summary.json) instead")
    return p


def run_main(main: Callable[[], object]) -> None:
    """A script's ``if __name__ == "__main__"``: ``main()``'s return value is the exit status, and a
    ``--from-multirun`` folder without the jobs it reads ends the script in one line, not a traceback.

    Raises:
        SystemExit: always (the status, or that line).
    """
    try:
        status = main()
    except MultirunError as exc:
        raise SystemExit(f"--from-multirun: {exc}") from None
    raise SystemExit(status)


def throughput_rows_from_command_line(description: str, experiments: Sequence[str],
                                     tiny: dict[str, Sequence[str]],
                                     collect: Callable[[list[Path]], tuple],
                                     measure: Callable[[argparse.Namespace, dict[str, DictConfig]], tuple],
                                     ) -> tuple[argparse.Namespace, tuple]:
    """Tables 2 and 3: parse their command line (with ``--gpu``), then ``collect`` a sweep
    (``--from-multirun``) or ``measure`` with the composed configs; ``--out`` is created.

    Returns ``(args, (rows, header, table, text))``.

    Raises:
        ValueError: what ``configs``, ``collect`` or ``measure`` raise.
    """
    p = parser(description, experiments, multirun=True)
    p.add_argument("--gpu", action="store_true", help="measure every K with enough CUDA GPUs (cuda:0..K-1)")
    args = p.parse_args()
    result = collect(args.from_multirun) if args.from_multirun else measure(args, configs(args, experiments, tiny))
    args.out.mkdir(parents=True, exist_ok=True)
    return args, result


def configs(args: argparse.Namespace, defaults: Sequence[str], tiny: dict[str, Sequence[str]] | None = None,
            ) -> dict[str, DictConfig]:
    """Compose each selected experiment (``--experiment`` or ``defaults``): ``--tiny``'s overrides
    (``tiny[name]``) first, then the command line's. A ``key=value`` override goes to every selected
    config that has ``key`` (``+key=``/``~key`` to all), so ``model.num_filters=8`` changes the AmoebaNet
    config of a script that also reads a Transformer one.

    Raises:
        ValueError: an override that is not ``key=value``, or whose key none of the configs has;
            an unknown experiment name.
    """
    overrides = list(getattr(args, "overrides", []))
    bad = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if bad:
        raise ValueError(f"override {bad[0]!r} is not key=value (e.g. experiment.steps=1)")
    names = getattr(args, "experiment", None) or list(defaults)
    first = (tiny or {}) if args.tiny else {}
    base = {n: compose_experiment(n, first.get(n, ())) for n in names}
    absent = object()

    def has(cfg: DictConfig, override: str) -> bool:
        key = override.split("=", 1)[0]
        return key.startswith(("+", "~")) or OmegaConf.select(cfg, key, default=absent) is not absent

    unused = [o for o in overrides if not any(has(c, o) for c in base.values())]
    if unused:
        raise ValueError(f"override {unused[0]!r}: no key {unused[0].split('=', 1)[0]!r} in "
                         f"{', '.join(names)} (add a key with +key=value)")
    return {n: compose_experiment(n, [*first.get(n, ()), *(o for o in overrides if has(c, o))])
            if overrides else c for n, c in base.items()}


def write(out: Path, name: str, markdown: str, data: object | None = None) -> Path:
    """Write ``name`` (markdown) and, with ``data``, ``name``'s JSON twin; returns the markdown path.

    The JSON carries ``provenance_meta()`` under ``meta``: a dict ``data`` gains that key, any
    other value is stored under ``rows``.
    """
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(markdown.rstrip() + "\n")
    if data is not None:
        body = {"meta": provenance_meta(), **data} if isinstance(data, dict) else {"meta": provenance_meta(), "rows": data}
        path.with_suffix(".json").write_text(json.dumps(body, indent=2, default=str) + "\n")
    return path


def save_figure(fig: object, path: Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure with its provenance (commit and command) in the PNG's metadata."""
    fig.savefig(path, dpi=dpi, metadata=figure_metadata())
    return path


def panel_figure(path: Path, labels: Sequence[str], names: dict[str, str], draw: Callable[[Any, str], None],
                 xlabel: str, ylabel: str, panel_size: tuple[float, float]) -> Path:
    """One panel per workload of ``labels``, drawn by ``draw(ax, label)`` on a log2 x axis and titled
    ``names[label]`` as our CPU analogue; saved at ``path`` with its provenance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width, height = panel_size
    fig, axes = plt.subplots(1, len(labels), figsize=(width * len(labels), height), squeeze=False)
    for ax, label in zip(axes[0], labels):
        draw(ax, label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(names[label] + " (ours: CPU analogue)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def log_wandb(enabled: bool, out: Path, name: str, tables: dict[str, tuple[Sequence[str], list]],
              images: Sequence[Path] = (), summary: dict[str, object] | None = None) -> None:
    """Log tables (name -> (columns, rows)), images and a summary to an offline wandb run.

    Does nothing unless ``enabled``. Raises ``ImportError`` if wandb is missing.
    """
    if not enabled:
        return
    import wandb

    run = wandb.init(project="gpipe-lab-paper", name=name, mode="offline", dir=str(out),
                     config={"argv": sys.argv}, reinit=True)
    try:
        for key, (columns, rows) in tables.items():
            run.log({key: wandb.Table(columns=list(columns), data=[[str(c) for c in r] for r in rows])})
        for image in images:
            run.log({image.stem: wandb.Image(str(image))})
        if summary:
            run.summary.update(summary)
    finally:
        run.finish()


def fmt_bytes(n: float, unit: str = "G") -> str:
    """Bytes in GiB (``G``) with two decimals."""
    return f"{n / 2**30:.2f}{unit}"


def fmt_count(n: float) -> str:
    """82M / 1.05B style parameter counts."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
