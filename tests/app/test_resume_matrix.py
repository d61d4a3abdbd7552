"""Resume from the user's side: every model preset, either transport, the same K or another.

- Every preset in ``conf/model``: the config Hydra saves with a run (unresolved, with its
  ``${model.label_smoothing}`` interpolations) is the same model as the run that resumes it,
  and the distributed transport's checkpoint names each weight as the local one does (the
  model's own layer names: the preset's layers, narrowed to a few channels, built on ``meta``).
- The matrix (slow: a distributed launch costs tens of seconds on two busy cores), for the
  two tiny presets: a 2-step run per transport (K=2) keeps its step-1 checkpoint, resumed to
  step 2 locally and distributed, at K=2 and at another K. Each preset runs four of the eight
  (checkpoint's transport, resuming transport, K) cases, which hold every pair of those values
  (each transport resumes and is resumed at either K, from either transport) and both bitwise
  promises; the default model also resumes across transports at the same K. Where
  the README promises bitwise equality (the same transport, K and M) the resumed run's
  weights are bitwise the uninterrupted run's; elsewhere the resumed step's loss and the
  weights agree to float rounding (``docs/reliability.md``, Determinism). Test ids read
  ``<K>-<the checkpoint's transport>-<the resuming transport>``. Each run's checkpoint also exports
  (``gpipe-export``) as the weights of the unpipelined model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gpipe_lab.app.config.environment import model_overrides
from gpipe_lab.app.config.resume_checks import differing_keys
from gpipe_lab.models import build
from gpipe_lab.pipeline.distributed.state_dict import by_index, by_name
from helpers.app import CONF, gpipe_train, make_config, numbered_copy

PRESETS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_a_saved_config_is_the_same_model_as_the_run_that_resumes_it(preset, tmp_path):
    cfg = make_config(f"model={preset}")
    saved = tmp_path / "config.yaml"
    OmegaConf.save({k: v for k, v in cfg.items() if k != "hydra"}, saved)  # as Hydra writes .hydra/config.yaml
    assert "${" in saved.read_text() or not preset.startswith("transformer")
    assert differing_keys(OmegaConf.load(saved), cfg) == []
    assert differing_keys(OmegaConf.load(saved), make_config(f"model={preset}", "model.num_layers=1")) != []


#: the same layers (names and count), a few channels wide: building the 6B preset's even on meta takes a minute
NARROW = {"amoebanet": {"num_filters": 8}, "transformer": {"d_model": 8, "ffn_dim": 8, "num_heads": 2, "vocab_size": 16}}


@pytest.mark.parametrize("preset", PRESETS)
def test_the_distributed_checkpoint_names_every_layer_as_the_model_does(preset):
    overrides = {**model_overrides(make_config(f"model={preset}")), **NARROW[preset.split("_")[0]]}
    with torch.device("meta"):
        layers = build(preset, **overrides)
    names = list(layers._modules)
    indexed = {f"{i}.{rest}": v for i, layer in enumerate(layers) for rest, v in layer.state_dict().items()}
    assert by_name(indexed, names).keys() == layers.state_dict().keys()
    assert by_index(layers.state_dict(), names).keys() == indexed.keys()
    assert by_index(indexed, names).keys() == indexed.keys()  # a checkpoint written with indices still loads


# ---------------------------------------------------------------------- the matrix, through gpipe-train
SMALL = ["trainer=smoke", "logger=none", "trainer.limit_val_batches=0", "trainer.enable_checkpointing=true",
         "callbacks.checkpoint_every_n_steps=1", "callbacks.keep_checkpoints=-1",
         "data.num_train=16", "data.num_val=8", "data.batch_size=8", "pipeline.chunks=4",
         # one thread per stage: kernels sum in an order that depends on the thread count, which BatchNorm
         # amplifies (docs/reliability.md). SGD with momentum (a state to restore): Adam turns the float
         # noise of a gradient that is zero in theory (an attention key's bias) into a full step of lr
         "pipeline.threads_per_stage=1", "optimizer=sgd"]
MODELS = {
    "amoebanet_d_tiny": ["model.num_filters=8", "data.image_size=8", "model.image_size=8"],
    "transformer_tiny": ["experiment=transformer_tiny"],
}
#: K of the uninterrupted runs, and the other K a checkpoint resumes at (per transport: one process
#: per stage is the costly part of a distributed run)
K, OTHER_K = 2, {"local": 3, "distributed": 1}


def train(tmp: Path, name: str, model: str, transport: str, k: int, *extra: str) -> Path:
    """``gpipe-train`` to step 2 into ``tmp/name``; returns that run directory."""
    run_dir = tmp / name
    gpipe_train([*MODELS[model], *SMALL, f"pipeline.transport={transport}", f"pipeline.partitions={k}",
                 "trainer.max_steps=2", f"hydra.run.dir={run_dir}", *extra], tmp, timeout=300)
    return run_dir


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


def last_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["final_train_loss"]


@pytest.mark.slow  # two runs: about 12 s on two busy cores
def test_a_checkpoint_numbering_its_layers_still_resumes_bitwise(tmp_path):
    """A distributed checkpoint written before the transport kept the layer names (``layers.0.``)."""
    reference = train(tmp_path, "reference", "amoebanet_d_tiny", "local", K)
    numbered = reference / "checkpoints" / "numbered.ckpt"  # in its run directory: its saved config beside it
    numbered_copy(reference / "checkpoints" / "epoch=0-step=1.ckpt", numbered)
    resumed = train(tmp_path, "resumed", "amoebanet_d_tiny", "local", K, f"ckpt_path={numbered}")
    expected, got = weights(reference), weights(resumed)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())


# (checkpoint's transport, resuming transport, same K): every pair of values, the bitwise cases among them
COVERING = [("local", "local", True), ("distributed", "distributed", True),
            ("local", "distributed", False), ("distributed", "local", False)]
ACROSS = [("local", "distributed", True), ("distributed", "local", True)]
MATRIX = [(m, *case) for m in sorted(MODELS) for case in COVERING + (ACROSS if m == "amoebanet_d_tiny" else [])]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Callable[[str], tuple[Path, dict[str, Path]]]:
    """``uninterrupted(model)``: a scratch folder and one uninterrupted K=2 run per transport
    (checkpoints at steps 1, 2), made on the model's first use and kept for the module, in whatever
    order its tests run (a module fixture parametrized by model is remade at each change of model)."""
    made: dict[str, tuple[Path, dict[str, Path]]] = {}

    def runs(model: str) -> tuple[Path, dict[str, Path]]:
        if model not in made:
            tmp = tmp_path_factory.mktemp(model)
            made[model] = tmp, {t: train(tmp, f"{t}-reference", model, t, K) for t in ("local", "distributed")}
        return made[model]
    return runs


def by_model(model: str, *values: object) -> pytest.ParameterSet:
    """A case of ``model``: each model's cases share one xdist worker (its uninterrupted runs), the two
    models' cases run side by side."""
    return pytest.param(model, *values, marks=pytest.mark.xdist_group(f"resume_matrix:{model}"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("model", "source", "transport", "same_k"), [by_model(*case) for case in MATRIX],
                         ids=[f"{m}-{'same' if k else 'other'}-K-{s}-{t}" for m, s, t, k in MATRIX])
def test_every_checkpoint_resumes_on_either_transport_at_any_k(uninterrupted, model, source, transport, same_k):
    tmp, reference = uninterrupted(model)
    k = K if same_k else OTHER_K[transport]
    ckpt = reference[source] / "checkpoints" / "epoch=0-step=1.ckpt"
    resumed = train(tmp, f"{source}-to-{transport}-K{k}", model, transport, k, f"ckpt_path='{ckpt}'")
    summary = json.loads((resumed / "summary.json").read_text())
    assert (summary["steps"], summary["K"], summary["transport"]) == (2, k, transport)
    expected, got = weights(reference[transport]), weights(resumed)
    assert got.keys() == expected.keys() == weights(reference[source]).keys()
    if source == transport and same_k:  # the README's promise: bitwise the uninterrupted run
        assert last_loss(resumed) == last_loss(reference[transport])
        for name, value in expected.items():
            assert torch.equal(got[name], value), name
    else:
        assert last_loss(resumed) == pytest.approx(last_loss(reference[transport]), rel=1e-5)
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "transport"), [by_model(m, t) for m in sorted(MODELS) for t in ("local", "distributed")])
def test_every_transports_checkpoint_exports_as_the_unpipelined_model(uninterrupted, model, transport):
    """``gpipe-export``'s file loads strictly into the model as gpipe-train builds it, unpipelined
    (that it computes what the pipeline computes: ``tests/app/test_export.py``)."""
    from gpipe_lab.app.export import export
    from gpipe_lab.app.train import build_datamodule, build_module

    tmp, reference = uninterrupted(model)
    out = tmp / f"{transport}.pt"
    export(reference[transport] / "checkpoints" / "last.ckpt", out)
    cfg = OmegaConf.load(reference[transport] / ".hydra" / "config.yaml")
    layers = build_module(cfg, build_datamodule(cfg)).layers
    layers.load_state_dict(torch.load(out, weights_only=True))  # strict: every weight, under its name and shape
