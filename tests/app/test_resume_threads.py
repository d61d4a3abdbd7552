"""A resumed run keeps the thread count its CPU stages started with, whatever the machine's load.

The default threads per CPU stage follow the free cores (``gpipe_lab.pipeline.devices.cpu_share``), and
kernels reduce in an order that depends on the thread count: a K=1 run started on an idle machine
(two threads) and resumed on a busy one (where the default is one) must still continue bitwise like
the uninterrupted run. The load is injected (``cpu_share.busy_elsewhere``), the runs are
``gpipe-train`` in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpipe_lab.pipeline.devices import cpu_share
from helpers.app import SMALL, cli_here

#: K=1 on two cores (two threads when idle); SGD with momentum: a state the resume restores
RUN = [*SMALL, "trainer.limit_val_batches=0", "trainer.enable_checkpointing=true", "trainer.max_steps=2",
       "callbacks.checkpoint_every_n_steps=1", "callbacks.keep_checkpoints=-1", "pipeline.partitions=1",
       "pipeline.chunks=4", "optimizer=sgd"]


def load(monkeypatch: pytest.MonkeyPatch, busy: float) -> None:
    """Two usable cores, ``busy`` of them kept busy by other processes."""
    monkeypatch.setattr(cpu_share, "usable_cores", lambda: 2)
    monkeypatch.setattr(cpu_share, "busy_elsewhere", lambda: busy)


def last(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    return state["state_dict"], json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow  # three in-process runs of the app: 18 s on two shared cores
def test_a_run_resumed_on_a_busy_machine_continues_bitwise_with_its_first_thread_count(tmp_path, capsys,
                                                                                         monkeypatch):
    gpipe_train = cli_here(tmp_path, capsys, monkeypatch)
    load(monkeypatch, busy=0.0)
    assert gpipe_train(*RUN, f"hydra.run.dir={tmp_path / 'reference'}").code == 0
    expected, summary = last(tmp_path / "reference")
    assert summary["threads_per_stage"] == 2

    load(monkeypatch, busy=1.0)  # the default would now be one thread
    assert cpu_share.default_threads(1) == 1
    ckpt = tmp_path / "reference" / "checkpoints" / "epoch=0-step=1.ckpt"
    done = gpipe_train(*RUN, f"ckpt_path='{ckpt}'", f"hydra.run.dir={tmp_path / 'resumed'}")
    assert done.code == 0, done.err[-3000:]
    got, summary = last(tmp_path / "resumed")
    assert (summary["steps"], summary["threads_per_stage"]) == (2, 2)
    assert got.keys() == expected.keys()
    assert [k for k, v in expected.items() if not torch.equal(got[k], v)] == []

    # the user's own setting wins over the recorded one
    done = gpipe_train(*RUN, f"ckpt_path='{ckpt}'", "pipeline.threads_per_stage=1",
                       f"hydra.run.dir={tmp_path / 'chosen'}")
    assert done.code == 0, done.err[-3000:]
    assert last(tmp_path / "chosen")[1]["threads_per_stage"] == 1
