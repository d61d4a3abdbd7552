"""``gpipe-export CKPT OUT`` (also ``python -m gpipe_lab.app.export``): a trained pipeline as the unpipelined model.

    gpipe-export logs/train/runs/<time>/checkpoints/best.ckpt model.pt
    layers.load_state_dict(torch.load("model.pt", weights_only=True))   # layers: the nn.Sequential

A ``gpipe-train`` checkpoint of any K and transport holds the weights of the model's ``layers``
(an ``nn.Sequential``) under the model's own layer names, and the Lightning module, optimizer
and loop state around them. The export keeps the ``layers`` weights only, as the plain
``state_dict()`` of that ``nn.Sequential``: tensors under string keys, which ``torch.load`` reads
with ``weights_only=True`` and without the lab installed. A checkpoint written with layer indices
(the distributed transport before it kept the names) is renamed after the model its run's saved
config builds (``<run dir>/.hydra/config.yaml``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from gpipe_lab.app.config import ConfigError

#: where a PipelineModule holds its nn.Sequential
PREFIX = "layers."


def saved_layers(ckpt: Path) -> torch.nn.Sequential | None:
    """The layers of the model the checkpoint's run built (on ``meta``), if its config is saved."""
    from gpipe_lab.app.config.environment import model_overrides
    from gpipe_lab.app.config.resume_checks import saved_config
    from gpipe_lab.models import build

    saved = saved_config(ckpt)
    if saved is None or saved.get("model") is None:
        return None
    return build(saved.model.name, device="meta", **model_overrides(saved))


def unpipelined_state_dict(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The weights of the checkpoint's ``layers``, keyed as that ``nn.Sequential``'s ``state_dict()``.

    Raises:
        ConfigError: not a gpipe-train checkpoint, or one without ``layers`` weights, or with layer
            indices and no saved config to name them.
    """
    from gpipe_lab.app.config.resume_checks import read_checkpoint
    from gpipe_lab.pipeline.distributed.state_dict import named_after

    saved = read_checkpoint(ckpt, key="checkpoint")["state_dict"]
    state = {k[len(PREFIX):]: v.detach().clone().contiguous() for k, v in saved.items() if k.startswith(PREFIX)}
    if not state:
        raise ConfigError(f"checkpoint={ckpt}: no weights under {PREFIX!r}: not the checkpoint of a gpipe-train model")
    if all(k.split(".", 1)[0].isdigit() for k in state):  # numbered: rename after the model (if it names them)
        layers = saved_layers(Path(ckpt))
        if layers is None:
            raise ConfigError(f"checkpoint={ckpt}: its layers are numbered and no .hydra/config.yaml of its run "
                              f"says which model they belong to; keep the checkpoint in its run directory")
        state = named_after(state, layers)
    return state


def export(ckpt: str | Path, out: str | Path) -> dict[str, torch.Tensor]:
    """Write ``unpipelined_state_dict(ckpt)`` to ``out`` (folders created); returns it.

    Raises:
        ConfigError: see ``unpipelined_state_dict``.
    """
    state = unpipelined_state_dict(ckpt)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    return state


def cli(argv: list[str] | None = None) -> None:
    """``gpipe-export``.

    Raises:
        SystemExit: one line for a file that cannot be exported.
    """
    p = argparse.ArgumentParser(prog="gpipe-export", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", type=Path, help="a gpipe-train checkpoint (last.ckpt, best.ckpt, any K and transport)")
    p.add_argument("out", type=Path, help="the file to write: the nn.Sequential's state dict")
    args = p.parse_args(argv)
    if not args.checkpoint.is_file():
        raise SystemExit(f"export error: checkpoint={args.checkpoint}: no such file; give a run's "
                         f"checkpoints/last.ckpt or best.ckpt")
    try:
        state = export(args.checkpoint, args.out)
    except ConfigError as exc:
        raise SystemExit(f"export error: {exc}") from None
    params = sum(v.numel() for v in state.values() if v.is_floating_point())
    print(f"exported {len(state)} tensors ({params:,} values) of {args.checkpoint} -> {args.out}; load with "
          f"layers.load_state_dict(torch.load({str(args.out)!r}, weights_only=True))", file=sys.stdout)


if __name__ == "__main__":
    cli()
