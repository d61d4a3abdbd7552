"""What a ``gpipe-train`` run starts from, checked and fetched before its trainer is built:
the dataset (``data.download``), the checkpoint to resume (``ckpt_path``) and the weights to
start from (``init_from``, or an experiment's ``transfer.checkpoint``); and where Hydra saved the
composed config it runs (``saved_config_path``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig

from gpipe_lab.app.config import ConfigError
from gpipe_lab.app.config.resume_checks import check_resume
from gpipe_lab.app.evaluation import check_weights, evaluates
from gpipe_lab.data.checks import DataNotFoundError
from gpipe_lab.lightning.resume import load_initial_weights


def fetch_data(cfg: DictConfig, datamodule: Any) -> None:
    """``data.download=true``: fetch the dataset now, before a logger starts, so that a machine
    without internet gets one line.

    Raises:
        ConfigError: the download failed (naming ``data.download`` and the local alternative).
    """
    if not cfg.data.get("download"):
        return
    try:
        datamodule.prepare_data()
    except DataNotFoundError:
        raise
    except OSError as exc:
        reason = str(getattr(exc, "reason", None) or exc).splitlines()[0]
        raise ConfigError(f"data.download=true: fetching {cfg.data.name} failed ({reason}); without internet, "
                          f"copy the dataset's files under data.root={cfg.data.get('root')} and set "
                          f"data.download=false") from None


def init_from_of(cfg: DictConfig) -> str | None:
    """The checkpoint whose weights start a new run: ``init_from``, else (when not resuming)
    an experiment's ``transfer.checkpoint``."""
    if cfg.get("init_from") is not None:
        return str(cfg.init_from)
    transfer = cfg.get("transfer")
    if cfg.get("ckpt_path") is None and transfer is not None and transfer.get("checkpoint") is not None:
        return str(transfer.checkpoint)
    return None


def load_weights(cfg: DictConfig, module: Any, ckpt_path: str | None) -> str | None:
    """Check the checkpoint to resume (or with ``mode=validate|test`` to evaluate) against the
    module, or load ``init_from``'s weights into it; returns the ``init_from`` checkpoint.

    Raises:
        ConfigError: the checkpoint cannot continue this run (``check_resume``), or its weights do
            not fit the model it is evaluated with (``check_weights``).
    """
    if ckpt_path is not None and evaluates(cfg):
        check_weights(ckpt_path, module)  # evaluated, not continued: its step and optimizer do not matter
    elif ckpt_path is not None:
        check_resume(ckpt_path, cfg, module)
    init_from = init_from_of(cfg)
    if init_from is not None:
        fresh = load_initial_weights(module, init_from, fresh_classifier=bool(cfg.get("fresh_classifier", True)))
        print(f"init_from {init_from}: loaded every weight but {len(fresh)} new one(s) "
              f"{fresh[:4]}{' ...' if len(fresh) > 4 else ''}")
    return init_from


def saved_config_path() -> Path | None:
    """Where Hydra saved this run's composed config (``<run dir>/.hydra/config.yaml``); ``None``
    outside a Hydra run or where it saves none (the processes Lightning or torchrun add)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra_cfg = cast(DictConfig, HydraConfig.get())  # a DictConfig, typed as Hydra's dataclass
    subdir, run_dir = hydra_cfg.get("output_subdir"), hydra_cfg.runtime.get("output_dir")
    path = Path(run_dir) / subdir / "config.yaml" if subdir and run_dir else None
    return path if path is not None and path.is_file() else None
