"""``ckpt_path=...`` continues the checkpoint's run: its overrides, its wandb run, a link to it.

When ``gpipe-train`` resumes a checkpoint that lies in another run directory
(``<old run>/checkpoints/*.ckpt``, e.g. ``ckpt_path=last``), ``continue_run``:

- recomposes the config from the old run's command-line overrides (``.hydra/overrides.yaml``)
  followed by this command's, so only what changes needs typing (this command wins);
- names the old run's wandb run, which ``gpipe_lab.app.wandb_run`` continues (same id);
- links the old run from the new run directory as ``resumed_run`` (the new directory holds
  the continued checkpoints, summary and logs).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from omegaconf import DictConfig, OmegaConf

#: Overrides of the old run that never carry over.
NOT_CARRIED = ("ckpt_path", "init_from", "hydra", "dry_run")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def wandb_run_id(run_dir: Path) -> str | None:
    """The id of the newest wandb run under ``run_dir/wandb`` (``[offline-]run-<time>-<id>``)."""
    runs = sorted((run_dir / "wandb").glob("*run-*-*"), key=lambda p: p.name.split("run-", 1)[1])
    return runs[-1].name.rsplit("-", 1)[1] if runs else None


def continue_run(cfg: DictConfig) -> DictConfig:
    """See the module docstring; returns ``cfg`` unchanged outside a Hydra run, without
    ``ckpt_path``, when the checkpoint is not found (``gpipe_lab.app.config.check_config`` then
    says so in one line) or when it has no saved run around it."""
    if cfg.get("ckpt_path") is None:
        return cfg
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    from gpipe_lab.app.config.environment import runs_dir_of
    from gpipe_lab.app.evaluation import evaluates
    from gpipe_lab.lightning.resume import resolve_ckpt_path

    try:
        hydra_cfg = cast(DictConfig, HydraConfig.get())  # a DictConfig, typed as Hydra's dataclass
    except ValueError:  # called outside a Hydra run
        return cfg
    run_dir = OmegaConf.select(hydra_cfg, "runtime.output_dir", throw_on_missing=False)
    if run_dir is None:  # a composed config (compose API, tests), not a run
        return cfg
    output_dir = Path(run_dir)
    try:
        ckpt = resolve_ckpt_path(str(cfg.ckpt_path), output_dir, runs_dir_of(cfg))
    except FileNotFoundError:
        return cfg
    if ckpt is None or not Path(ckpt).is_file():
        return cfg
    old_run = Path(ckpt).resolve().parent.parent
    saved = old_run / ".hydra" / "overrides.yaml"
    if old_run == output_dir.resolve() or not saved.is_file():
        return cfg
    current = [o for o in hydra_cfg.overrides.task if _key(o) != "ckpt_path"]
    given = {_key(o) for o in current}
    carried = [o for o in map(str, OmegaConf.load(saved))
               if _key(o) not in given and not _key(o).startswith(NOT_CARRIED)]
    new_cfg = compose(hydra_cfg.job.config_name, overrides=[*carried, *current, f"ckpt_path='{ckpt}'"])
    run_id = wandb_run_id(old_run)  # continued (and rewound) by gpipe_lab.app.wandb_run
    link = output_dir / "resumed_run"
    if not link.exists():
        link.symlink_to(old_run, target_is_directory=True)
    continued = not evaluates(new_cfg)  # mode=validate|test evaluates it in a run of its own
    wandb_note = f" (wandb id {run_id})" if continued and run_id is not None and new_cfg.logger.get("name") == "wandb" else ""
    given_note = f"; its overrides: {' '.join(carried)}" if carried else ""
    given_note += f"; this command's: {' '.join(current)}" if current else ""
    print(f"{'continuing run' if continued else f'evaluating {ckpt} of run'} {old_run}{wandb_note}{given_note}")
    return new_cfg
