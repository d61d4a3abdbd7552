"""Transfer learning (paper §4): load an AmoebaNet checkpoint, swap in a fresh classifier, fine-tune.

    python -m experiments.transfer                                  # synthetic end-to-end, results/transfer.md
    python -m experiments.transfer --experiment transfer_cifar10 transfer.checkpoint=/ckpt/amoebanet.ckpt
    python -m experiments.transfer --tiny --out /tmp/transfer

Configs are Hydra ``experiment=`` files (``conf/experiment/transfer_*.yaml``)
composed with the app's ``train.yaml``; their ``transfer`` block names the
checkpoint, the steps and the augmentation. With ``transfer.checkpoint: null``
the script first pretrains on ``transfer.pretrain_class_offset``'s classes and
saves that checkpoint. Fine-tuning runs through GPipe (deferred BatchNorm) and
compares the pretrained start with a scratch start at equal steps. The real
datasets' rows are filled when their files exist under ``data.root``.
"""

from __future__ import annotations

if not __package__:  # started as a file (``python experiments/transfer.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from experiments.common import log_wandb, parser, write
from gpipe_lab.app.config.experiments import compose_experiment, experiment_names
from gpipe_lab.bench import Progress, md_table
from gpipe_lab.bench.machine import provenance
from gpipe_lab.data import Cutout, build_datamodule
from gpipe_lab.models import build
from gpipe_lab.pipeline import GPipe

PAPER = [("transfer_cifar10", "CIFAR-10", 99.0), ("transfer_cifar100", "CIFAR-100", 91.3),
         ("transfer_cars", "Stanford Cars", 94.6), ("transfer_pets", "Oxford-IIIT Pets", 95.9),
         ("transfer_food101", "Food-101", 93.0), ("transfer_aircraft", "FGVC Aircraft", 92.7),
         ("transfer_birdsnap", "Birdsnap", 83.6)]


def load_config(experiment: str, overrides: list[str]) -> DictConfig:
    """Compose ``train.yaml`` with ``experiment=<experiment>`` and ``overrides`` (no Hydra run).

    Raises:
        ValueError: not a ``transfer_*`` experiment (naming the allowed ones).
    """
    allowed = [n for n in experiment_names() if n.startswith("transfer_")]
    if experiment not in allowed:
        raise ValueError(f"experiment {experiment!r} is not a transfer experiment; allowed: {', '.join(allowed)}")
    return compose_experiment(experiment, overrides)


def load_backbone(model: torch.nn.Sequential, checkpoint: str | Path) -> list[str]:
    """Load every layer but the classifier from a state dict or Lightning checkpoint; returns missing keys.

    Raises:
        RuntimeError: a non-classifier weight is missing or has another shape.
    """
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    state = state.get("state_dict", state)
    state = {k.split("layers.", 1)[-1] if k.startswith(("layers.", "model.layers.")) else k: v
             for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.startswith("classifier.")}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise RuntimeError(f"checkpoint {checkpoint} does not match the model outside the classifier: "
                           f"{str(exc)[:300]}") from None
    bad = [k for k in missing if not k.startswith("classifier.")] + list(unexpected)
    if bad:
        raise RuntimeError(f"checkpoint {checkpoint} does not match the model outside the classifier: {bad[:5]}")
    return list(missing)


def augment(x: torch.Tensor, flip: bool, cutout: int) -> torch.Tensor:
    """Random horizontal flips (p=0.5) and cutout squares, per sample."""
    if flip:
        mask = torch.rand(x.shape[0]) < 0.5
        x = torch.where(mask[:, None, None, None], x.flip(-1), x)
    if cutout:
        cut = Cutout(cutout)
        x = torch.stack([cut(img.clone()) for img in x])
    return x


def train(cfg: DictConfig, model: torch.nn.Sequential, data: object, steps: int, lr: float, seed: int) -> None:
    """``steps`` SGD steps through GPipe with the config's K, M and augmentation."""
    pipe = GPipe(model, partitions=cfg.pipeline.partitions, chunks=cfg.pipeline.chunks, seed=seed,
                 deferred_batch_norm=bool(cfg.pipeline.deferred_batch_norm), threads_per_stage=1)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    done = 0
    while done < steps:
        for x, y in data.train_dataloader():  # type: ignore[attr-defined]
            if done >= steps:
                break
            x = augment(x, bool(cfg.transfer.random_flip), int(cfg.transfer.cutout))
            pipe.train_step(x, y, F.cross_entropy)
            opt.step()
            opt.zero_grad(set_to_none=True)
            done += 1


def accuracy(model: torch.nn.Sequential, data: object) -> float:
    """Top-1 accuracy (%) on the validation loader."""
    model.eval()
    right = total = 0
    with torch.no_grad():
        for x, y in data.val_dataloader():  # type: ignore[attr-defined]
            right += int((model(x).argmax(-1) == y).sum())
            total += len(y)
    model.train()
    return 100.0 * right / max(total, 1)


def datamodule(cfg: DictConfig, **changes: object) -> object:
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k != "name"}
    return build_datamodule(cfg.data.name, seed=cfg.seed, **{**kwargs, **changes})


def model_for(cfg: DictConfig, classes: int, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    sizes = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k not in ("name", "task")}
    return build(cfg.model.name, "cpu", **{**sizes, "num_classes": classes})


def run(cfg: DictConfig, out: Path, seed: int) -> dict[str, float]:
    """Pretrain if needed, then fine-tune from the checkpoint and from scratch; returns accuracies."""
    t = cfg.transfer
    data = datamodule(cfg)
    classes = int(data.num_classes)  # type: ignore[attr-defined]
    checkpoint = t.checkpoint
    if checkpoint is None and (t.pretrain_class_offset is None or not t.pretrain_steps):
        raise ValueError(f"transfer.checkpoint is required for {cfg.transfer.dataset_label}: pass "
                         "transfer.checkpoint=/path/to/amoebanet.ckpt (a pretrained model of the same preset)")
    if checkpoint is None:
        source = datamodule(cfg, class_offset=int(t.pretrain_class_offset))
        pre = model_for(cfg, classes, seed)
        train(cfg, pre, source, int(t.pretrain_steps), float(t.lr), seed)
        (out / "transfer_checkpoints").mkdir(parents=True, exist_ok=True)
        checkpoint = out / "transfer_checkpoints" / f"pretrained_seed{seed}.pt"
        torch.save(pre.state_dict(), checkpoint)
    tuned = model_for(cfg, classes, seed + 100)
    missing = load_backbone(tuned, checkpoint)
    assert missing and all(k.startswith("classifier.") for k in missing)
    scratch = model_for(cfg, classes, seed + 100)
    train(cfg, tuned, data, int(t.steps), float(t.lr), seed)
    train(cfg, scratch, data, int(t.steps), float(t.lr), seed)
    return {"pretrained": accuracy(tuned, data), "scratch": accuracy(scratch, data)}


def main() -> None:
    """Run one transfer experiment and write ``transfer.md`` / ``.json`` under ``--out``."""
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--experiment", default="transfer_synthetic", help="a conf/experiment/transfer_*.yaml")
    p.add_argument("--seeds", type=int, help="seeds 0..N-1 (default: the config's transfer.seeds)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. transfer.checkpoint=/x.ckpt")
    args = p.parse_args()
    torch.set_num_threads(1)
    tiny = ["transfer.pretrain_steps=4", "transfer.steps=2", "data.num_train=128", "data.num_val=32",
            "model.num_filters=8"] if args.tiny else []
    overrides = tiny + list(args.overrides)  # the command line's own overrides win over --tiny's
    cfg = load_config(args.experiment, overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    from omegaconf import OmegaConf

    seeds = [0] if args.tiny else (list(range(args.seeds)) if args.seeds
                                   else [int(x) for x in OmegaConf.select(cfg, "transfer.seeds", default=[0, 1])])
    progress = Progress(len(seeds), "transfer", note=f"writing to {args.out}")
    results = []
    for s in seeds:
        results.append(run(cfg, args.out, s))
        progress.done(f"seed {s}: pretrain, fine-tune, from scratch")
    mean = {k: sum(r[k] for r in results) / len(results) for k in results[0]}

    def spread(key: str) -> str:
        values = [r[key] for r in results]
        return f"{mean[key]:.1f}" + (f" [{min(values):.1f}, {max(values):.1f}]" if len(values) > 1 else "")

    label = cfg.transfer.dataset_label
    header = ["dataset", "config", "paper top-1 (AmoebaNet-B, ImageNet-pretrained)", "ours: pretrained",
              "ours: scratch, same steps", "status"]
    rows = [[label, args.experiment, cfg.transfer.paper_top1 or "-", spread("pretrained"), spread("scratch"),
             f"run here ({len(seeds)} seed(s) {seeds}, mean [min, max]; {cfg.transfer.steps} fine-tuning steps)"]]
    for name, dataset, top1 in PAPER:
        if name != args.experiment:
            root = Path(load_config(name, []).data.root)
            status = (f"data found at {root}: run with transfer.checkpoint=<ImageNet AmoebaNet>" if root.exists()
                      else f"not run: no files at {root} and no ImageNet checkpoint (no downloads here)")
            rows.append([dataset, name, top1, "-", "-", status])
    md = ["# Transfer learning: fine-tune a pretrained AmoebaNet with a fresh classifier", "", provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}Model `{cfg.model.name}` "
          f"{ {k: v for k, v in cfg.model.items() if k != 'name'} }, GPipe K={cfg.pipeline.partitions}, "
          f"M={cfg.pipeline.chunks}, deferred BatchNorm, SGD momentum 0.9 lr {cfg.transfer.lr}; augmentation: the "
          f"datamodule's random flips ({OmegaConf.select(cfg, 'data.random_flip', default=False)}) and cutout "
          f"{OmegaConf.select(cfg, 'data.cutout', default=0)} (data.random_flip / data.cutout), plus the loop's own "
          f"flips ({bool(cfg.transfer.random_flip)}) and cutout {cfg.transfer.cutout} (transfer.random_flip / "
          f"transfer.cutout). Pretraining: {cfg.transfer.pretrain_steps} steps on a disjoint "
          "class set (synthetic) — the checkpoint's classifier is dropped and a fresh one trained.", "",
          md_table(header, rows), "",
          f"Per seed (pretrained / scratch top-1 %): {[(round(r['pretrained'], 1), round(r['scratch'], 1)) for r in results]}. "
          f"Pretrained {'beats' if mean['pretrained'] > mean['scratch'] else 'does NOT beat'} scratch at equal "
          "fine-tuning steps here. The paper's numbers need ImageNet pretraining of a 557M-parameter model "
          "and the real datasets; the `transfer_*` configs run them where both exist.", ""]
    path = write(args.out, "transfer.md", "\n".join(md), {"experiment": args.experiment, "runs": results})
    log_wandb(args.wandb, args.out, "transfer", {"transfer": (header, rows)}, summary=mean)
    print(path)


if __name__ == "__main__":
    main()
