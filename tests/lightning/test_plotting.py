"""The timeline picture: one box per event, measured beside predicted on the same scale."""

from __future__ import annotations

import matplotlib
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline import get_schedule
from gpipe_lab.planner import StageCosts, costs_from_timeline, predict_step
from gpipe_lab.plotting import COLORS, plot_timeline


def test_measured_and_predicted_panels_have_one_box_per_event(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    pipe = GPipe(model, partitions=2, chunks=4, schedule="zb-h1", checkpoint="always")
    pipe.train_step(torch.randn(16, 16), torch.randn(16, 16), F.mse_loss)
    measured = pipe.timeline
    predicted = predict_step(get_schedule("zb-h1", 2, 4), costs_from_timeline(measured)).timeline
    path = tmp_path / "sub" / "timeline.png"
    fig = plot_timeline(measured, path, title="zb-h1 K=2 M=4", predicted=predicted)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    top, bottom = fig.axes
    assert len(top.patches) == len(measured.events)
    assert len(bottom.patches) == len(predicted.events)
    assert top.get_xlim() == bottom.get_xlim()  # same scale
    kinds = {e.kind for e in measured.events}
    assert {"F", "B", "W", "R"} <= kinds
    colors = {matplotlib.colors.to_hex(p.get_facecolor()) for p in top.patches}
    assert colors <= set(COLORS.values())
    labels = [t.get_text() for t in top.texts]
    assert all(label.isdigit() for label in labels)


def test_single_predicted_timeline_without_saving():
    pred = predict_step(get_schedule("1f1b", 3, 6), StageCosts.uniform(3)).timeline
    fig = plot_timeline(pred)
    (ax,) = fig.axes
    assert len(ax.patches) == len(pred.events) == 3 * 2 * 6 + sum(e.kind == "wait" for e in pred.events)
    assert len(ax.texts) == 3 * 2 * 6
