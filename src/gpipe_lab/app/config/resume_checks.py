"""Checks before ``gpipe-train`` resumes a checkpoint, so a wrong resume fails in one clear line.

``check_resume(ckpt_path, cfg, module)`` compares the checkpoint with the run about to start:

- the checkpoint's step already reaches ``trainer.max_steps``: nothing would train; the message
  gives the command that continues (a larger ``trainer.max_steps``);
- another optimizer than the one the checkpoint's state belongs to: both are named, with the
  ``init_from`` alternative (weights only);
- another model: the keys of the saved config (``<run dir>/.hydra/config.yaml``) that differ
  from the run's are named; without a saved config, the weights that differ in name or shape;
- a file that is no checkpoint (another kind of file, a truncated or damaged one).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from gpipe_lab.app.config.schema import ConfigError, resolved_dict
from gpipe_lab.lightning.pipeline_module import PipelineModule
from gpipe_lab.pipeline.distributed.state_dict import named_after

#: The config keys that decide the weights' names and shapes.
MODEL_SECTIONS = ("model",)
MODEL_DATA_KEYS = ("num_classes", "image_size", "vocab_size")


def saved_config(ckpt_path: str | Path) -> DictConfig | None:
    """The config Hydra saved for the checkpoint's run (``<run>/.hydra/config.yaml``), if any."""
    path = Path(ckpt_path).resolve().parent.parent / ".hydra" / "config.yaml"
    loaded = OmegaConf.load(path) if path.is_file() else None
    return loaded if isinstance(loaded, DictConfig) else None


def read_checkpoint(path: str | Path, key: str = "ckpt_path") -> dict[str, Any]:
    """The Lightning checkpoint at ``path`` (on the CPU).

    Raises:
        ConfigError: the file is not one (``key`` and the path named, with torch's reason).
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, ImportError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{key}={path}: not a checkpoint torch can read ({type(exc).__name__}: {reason}); the "
                          f"file is damaged, truncated or of another kind: give a run's checkpoints/last.ckpt") from None
    if not isinstance(state, dict) or "state_dict" not in state:
        raise ConfigError(f"{key}={path}: not a gpipe-train checkpoint (no state_dict, optimizer and step in it); "
                          f"give a run's checkpoints/last.ckpt (init_from= takes plain weights)")
    return state


def optimizer_of_state(state: dict[str, Any]) -> str | None:
    """``sgd`` or ``adam``-family, from the keys of a saved optimizer state (None if unknown)."""
    groups = (state.get("optimizer_states") or [{}])[0].get("param_groups") or [{}]
    if "momentum" in groups[0] and "betas" not in groups[0]:
        return "sgd"
    return "adam" if "betas" in groups[0] else None


def differing_keys(saved: DictConfig, cfg: DictConfig) -> list[str]:
    """``key: checkpoint X, this run Y`` for the model keys (and shape-deciding data keys) that differ.

    Both sides are compared resolved: Hydra saves the config with its interpolations
    (``label_smoothing: ${model.label_smoothing}``), the run holds their values.
    """
    old = {f"model.{k}": v for k, v in resolved_dict(saved.model).items()}
    new = {f"model.{k}": v for k, v in resolved_dict(cfg.model).items()}
    for key in MODEL_DATA_KEYS:
        old[f"data.{key}"], new[f"data.{key}"] = saved.data.get(key), cfg.data.get(key)
    return [f"{k}: checkpoint {old.get(k)!r}, this run {new.get(k)!r}"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def differing_weights(state: dict[str, Any], module: torch.nn.Module) -> list[str]:
    """``name: checkpoint shape vs model shape`` for weights missing on either side or of another shape
    (a checkpoint numbering the layers compared under their names, as the module loads it)."""
    saved = state.get("state_dict", {})
    if isinstance(module, PipelineModule):
        saved = named_after(saved, module.configure_layers(), module.layers_prefix())
    own = module.state_dict()
    out = []
    for k in sorted(set(saved) | set(own)):
        a = tuple(saved[k].shape) if k in saved else "missing"
        b = tuple(own[k].shape) if k in own else "missing"
        if a != b:
            out.append(f"{k}: checkpoint {a} vs model {b}")
    return out


def check_resume(ckpt_path: str, cfg: DictConfig, module: torch.nn.Module) -> None:
    """See the module docstring.

    Raises:
        ConfigError: the checkpoint cannot continue this run (the message says why and what to run).
    """
    state = read_checkpoint(ckpt_path)
    saved = saved_config(ckpt_path)
    if saved is not None and saved.get("model") is not None:
        diff = differing_keys(saved, cfg)
        if diff:
            raise ConfigError(f"ckpt_path={ckpt_path}: the checkpoint is of another model than this run "
                              f"({'; '.join(diff[:6])}); resume with the checkpoint's values, or start a new "
                              f"run from its weights with init_from")
    bad = differing_weights(state, module)
    if bad:
        raise ConfigError(f"ckpt_path={ckpt_path}: {len(bad)} weight(s) of the checkpoint do not fit this run's "
                          f"model ({'; '.join(bad[:4])}{' ...' if len(bad) > 4 else ''})")
    configured = cfg.optimizer.name
    if saved is not None and saved.get("optimizer") is not None:
        had, same = saved.optimizer.name, saved.optimizer.name == configured
    else:  # only the state's keys: sgd or the adam family
        had = optimizer_of_state(state)
        same = had is None or had == ("sgd" if configured == "sgd" else "adam")
    if not same:
        raise ConfigError(f"optimizer.name: this run uses {configured!r} but the checkpoint {ckpt_path} holds "
                          f"the state of {had!r}; resume with optimizer={had}, or start a new run from its "
                          f"weights only with init_from={ckpt_path} (and no ckpt_path)")
    step, max_steps = int(state.get("global_step", 0)), cfg.trainer.get("max_steps", -1)
    if max_steps not in (None, -1) and step >= max_steps:
        raise ConfigError(f"trainer.max_steps: the checkpoint {ckpt_path} is at step {step}, which already reaches "
                          f"trainer.max_steps={max_steps}, so nothing would train; to continue, raise it, e.g. "
                          f"gpipe-train ckpt_path={ckpt_path} trainer.max_steps={step + max(max_steps, 1)}")
