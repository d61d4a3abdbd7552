"""Bad input at every user-facing entry is refused with the right type and a message that
names the key and its allowed range (or the values involved).

Entries: ``GPipe``, ``GPipeStrategy`` (construction and setup), ``gpipe-train``'s config
validation (composed through Hydra like the app does), ``gpipe-train``'s resume
(``ckpt_path``), ``gpipe-plan``, ``build_datamodule`` and ``models.build``.
GPipe's own construction errors are in test_pipeline_errors.py; only cases it does not
cover are here.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.app.config.groups import ConfigError

SMALL_APP = ["trainer=smoke", "logger=none", "data.num_train=16", "data.num_val=8", "data.batch_size=8",
             "model.num_filters=8", "data.image_size=8", "model.image_size=8"]


# ----------------------------------------------------------------------------- entries
def gpipe(**kwargs: object) -> Callable[[Path], object]:
    def call(_: Path) -> object:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
        return GPipe(model, **kwargs)

    return call


def gpipe_step(batch: int, **kwargs: object) -> Callable[[Path], object]:
    def call(tmp: Path) -> object:
        pipe = gpipe(**kwargs)(tmp)
        return pipe.train_step(torch.randn(batch, 4), torch.randn(batch, 4), F.mse_loss)

    return call


def strategy(**kwargs: object) -> Callable[[Path], object]:
    def call(_: Path) -> object:
        from gpipe_lab.lightning import GPipeStrategy

        return GPipeStrategy(**kwargs)

    return call


def strategy_fit(batch_size: int = 16, **kwargs: object) -> Callable[[Path], object]:
    """Errors found when the strategy builds the pipeline (they need the module's layers)."""

    def call(tmp: Path) -> object:
        from gpipe_lab.lightning import GPipeStrategy
        from helpers.strategy import TinyData, TinyRegressor, trainer

        return trainer(GPipeStrategy(**kwargs), max_steps=1, default_root_dir=str(tmp)).fit(
            TinyRegressor(), TinyData(batch_size=batch_size))

    return call


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from gpipe_lab.app.train import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def config(*overrides: str, num_layers: int | None = None) -> Callable[[Path], object]:
    """``gpipe-train``'s validation of the config composed from ``overrides`` (no training)."""

    def call(_: Path) -> object:
        from gpipe_lab.app.config.groups import validate

        return validate(compose(list(overrides)), num_layers=num_layers)

    return call


def train_resume(make_checkpoint: Callable[[Path], Path | str]) -> Callable[[Path], object]:
    """``gpipe-train ckpt_path=...`` in-process (``train.run``), small AmoebaNet config."""

    def call(tmp: Path) -> object:
        from gpipe_lab.app.train import run

        ckpt = make_checkpoint(tmp)
        return run(compose([*SMALL_APP, f"paths.log_dir={tmp}/logs", f"ckpt_path={ckpt}"]))

    return call


def other_model_checkpoint(tmp: Path) -> Path:
    """A Lightning checkpoint of a Transformer (the app's config trains an AmoebaNet)."""
    import lightning
    from gpipe_lab.lightning.modules import Translator
    from gpipe_lab.models import build

    path = tmp / "transformer.ckpt"
    torch.save({"state_dict": Translator(build("transformer_tiny")).state_dict(),
                "pytorch-lightning_version": lightning.__version__, "epoch": 0, "global_step": 0}, path)
    return path


def plan(*argv: str) -> Callable[[Path], object]:
    """``gpipe-plan ARGV``: a non-zero exit status becomes ``SystemExit(<its stderr>)``."""

    def call(_: Path) -> object:
        from gpipe_lab.planner.cli import main

        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                status = main(list(argv))
            except SystemExit as exc:
                status = exc.code
        if status:
            raise SystemExit(f"exit {status}: {err.getvalue()}")
        return status

    return call


def datamodule(name: str, **kwargs: object) -> Callable[[Path], object]:
    def call(_: Path) -> object:
        from gpipe_lab.data import build_datamodule

        return build_datamodule(name, **kwargs)

    return call


def model(name: str, **overrides: object) -> Callable[[Path], object]:
    def call(_: Path) -> object:
        from gpipe_lab.models import build

        return build(name, device="meta", **overrides)

    return call


# ----------------------------------------------------------------------------- cases
CASES = [
    # --- GPipe (engine)
    ("gpipe: balance longer than the devices", gpipe(balance=[2, 2, 2], devices=["cpu", "cpu"]),
     ValueError, "3 partitions need 3 devices, got 2"),
    ("gpipe: fractional chunks", gpipe(partitions=2, chunks=2.5), ValueError, "chunks:? must be an integer >= 1, got 2.5"),
    ("gpipe: K larger than layers with a cost list", gpipe(partitions=7, cost=[1.0] * 6),
     ValueError, "partitions: 7 partitions but the module has only 6 layers"),
    # --- GPipeStrategy
    ("strategy: unknown transport", strategy(transport="pigeon"), ValueError,
     "transport: must be one of \\['local', 'distributed'\\], got 'pigeon'"),
    ("strategy: unknown schedule", strategy(schedule="pipedream"), ValueError, "schedule: must be one of"),
    ("strategy: unknown checkpoint mode", strategy(checkpoint="sometimes"), ValueError,
     "checkpoint: must be one of \\['always', 'except_last', 'never'\\]"),
    ("strategy: M < 1", strategy(chunks=0), ValueError, "chunks: must be an integer >= 1, got 0"),
    ("strategy: K larger than the layers", strategy_fit(partitions=12), ValueError,
     "partitions: 12 partitions but the module has only 9 layers"),
    ("strategy: K larger than the stage devices", strategy_fit(partitions=3, stage_devices=["cpu", "cpu"]),
     ValueError, "3 partitions need 3 devices, got 2"),
    ("strategy: balance with the wrong sum", strategy_fit(balance=[4, 4]), ValueError,
     "sums to 8 but the module has 9 layers"),
    ("strategy: K < 1", strategy(partitions=0), ValueError, "partitions: must be an integer >= 1, got 0"),
    ("strategy: non-positive timeout", strategy(partitions=2, timeout=0), ValueError,
     "timeout: must be a finite number of seconds > 0, got 0"),
    # --- gpipe-train config validation (Hydra compose)
    ("config: K < 1", config("pipeline.partitions=0"), ConfigError, "pipeline.partitions: must be an integer >= 1, got 0"),
    ("config: K larger than the model's layers", config("pipeline.partitions=12", num_layers=9), ConfigError,
     "pipeline.partitions: 12 partitions but model 'amoebanet_d_tiny' has only 9 layers"),
    ("config: M < 1", config("pipeline.chunks=0"), ConfigError, "pipeline.chunks: must be an integer >= 1, got 0"),
    ("config: M larger than the batch", config("pipeline.chunks=64"), ConfigError,
     "pipeline.chunks: 64 micro-batches is more than data.batch_size=32"),
    ("config: balance length differs from K", config("pipeline.partitions=3", "pipeline.balance=[4,5]"),
     ConfigError, "pipeline.balance: \\[4, 5\\] has 2 entries but pipeline.partitions=3"),
    ("config: balance with the wrong sum", config("pipeline.partitions=null", "pipeline.balance=[1,2]", num_layers=9),
     ConfigError, "pipeline.balance: \\[1, 2\\] sums to 3 but model 'amoebanet_d_tiny' has 9 layers"),
    ("config: balance entry not positive", config("pipeline.partitions=null", "pipeline.balance=[0,9]"),
     ConfigError, "pipeline.balance: must be a non-empty list of positive layer counts, got \\[0, 9\\]"),
    ("config: unknown model", config("model.name=resnet"), ConfigError, "model.name: unknown preset 'resnet'; known: amoebanet_d"),
    ("config: unknown data", config("data.name=mnist"), ConfigError, "data.name: unknown datamodule 'mnist'; known: cifar10"),
    ("config: unknown schedule", config("pipeline.schedule=pipedream"), ConfigError,
     "pipeline.schedule: must be one of \\['1f1b', 'dualpipev', 'gpipe'"),
    ("config: batch size 0", config("data.batch_size=0"), ConfigError, "data.batch_size: must be a positive integer, got 0"),
    ("config: negative dataset size", config("data.num_train=-5"), ConfigError, "data.num_train: must be a positive integer"),
    ("config: world size not divisible by K", config("pipeline.transport=distributed", "trainer.devices=3"),
     ConfigError, "trainer.devices: world size 3 .* is not divisible by pipeline.partitions=2"),
    ("config: max_steps 0", config("trainer.max_steps=0"), ConfigError, "trainer.max_steps: must be a positive integer or -1"),
    # --- gpipe-train resume
    ("train: checkpoint file that does not exist", train_resume(lambda tmp: tmp / "missing.ckpt"),
     ConfigError, "ckpt_path=.*missing.ckpt: no such file"),
    ("train: checkpoint of a different model", train_resume(other_model_checkpoint), ConfigError,
     "weight\\(s\\) of the checkpoint do not fit this run's model \\(layers\\."),
    # --- gpipe-plan
    ("plan: K < 1", plan("memory", "--model", "amoebanet_d_tiny", "-K", "0"), SystemExit, "partitions must be >= 1, got 0"),
    ("plan: K larger than the layers", plan("memory", "--model", "amoebanet_d_tiny", "-K", "100"), SystemExit,
     "cannot cut 9 layers into 100 partitions"),
    ("plan: M larger than the batch", plan("memory", "--model", "amoebanet_d_tiny", "--batch", "8", "--microbatches", "16"),
     SystemExit, "batch 8 is not divisible by 16 micro-batches"),
    ("plan: M < 1", plan("memory", "--model", "amoebanet_d_tiny", "--microbatches", "0"), SystemExit,
     "--microbatches must be >= 1, got 0"),
    ("plan: batch 0", plan("memory", "--model", "amoebanet_d_tiny", "--batch", "0"), SystemExit,
     "--batch must be >= 1, got 0"),
    ("plan: negative memory", plan("memory", "--model", "amoebanet_d_tiny", "--memory-gib", "-1"), SystemExit,
     "--memory-gib must be > 0, got -1"),
    ("plan: unknown model", plan("memory", "--model", "resnet"), SystemExit, "unknown model preset 'resnet'; known presets"),
    ("plan: zero layers", plan("memory", "--model", "amoebanet_d_tiny", "--num-layers", "0"), SystemExit,
     "num_layers must be positive, got 0"),
    # --- datamodules
    ("data: unknown name", datamodule("mnist"), ValueError, "name must be one of \\['cifar10'"),
    ("data: batch size 0", datamodule("synthetic_images", batch_size=0), ValueError, "batch_size must be an integer >= 1, got 0"),
    ("data: image size too small", datamodule("synthetic_images", image_size=0), ValueError,
     "image_size must be an integer >= 8, got 0"),
    ("data: CIFAR path that does not exist", datamodule("cifar10", root="/nonexistent/cifar"), FileNotFoundError,
     "CIFAR-10 file not found at '/nonexistent/cifar"),
    ("data: ImageNet path that does not exist", datamodule("imagenet", root="/nonexistent/imagenet"),
     FileNotFoundError, "not found at '/nonexistent/imagenet/train'"),
    ("data: parallel text path that does not exist", datamodule("parallel_text", root="/nonexistent/wmt"),
     FileNotFoundError, "not found at '/nonexistent/wmt/train.src'"),
    ("data: replica rank out of range", datamodule("synthetic_images", data_parallel_rank=2, data_parallel_size=2),
     ValueError, "data_parallel_rank must be an integer in \\[0, 1\\], got 2"),
    ("data: unknown argument", datamodule("synthetic_images", foo=1), TypeError, "unexpected argument\\(s\\) \\['foo'\\]"),
    # --- models.build
    ("model: unknown name", model("resnet"), ValueError, "unknown model preset 'resnet'; known presets: amoebanet_d"),
    ("model: zero layers", model("amoebanet_d_tiny", num_layers=0), ValueError, "num_layers must be positive, got 0"),
    ("model: negative width", model("transformer_tiny", d_model=-1), ValueError, "d_model must be positive, got -1"),
    ("model: zero sequence length", model("transformer_tiny", seq_len=0), ValueError, "seq_len must be positive, got 0"),
    ("model: unknown override", model("transformer_tiny", depth=3), ValueError,
     "unknown override\\(s\\) \\['depth'\\] for preset 'transformer_tiny'; allowed: num_layers"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call,error,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_a_message_naming_the_key(call, error, fragment, tmp_path):
    with pytest.raises(error, match=fragment):
        call(tmp_path)
