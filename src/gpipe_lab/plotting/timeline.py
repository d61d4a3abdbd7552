"""Gantt chart of a pipeline step: stages x time, one box per action.

    fig = plot_timeline(pipe.timeline, "step.png", title="zb-h1, K=2, M=4",
                        predicted=predict_step(schedule, costs).timeline)

Boxes are colored by kind (F forward, B backward, W weight gradients, R
recompute, wait: blocked on a neighbour) and labelled with the micro-batch
number when wide enough; the legend names the kinds drawn, and a caption what
the grey and the white gaps mean. With ``predicted``, the measured and the predicted
timelines are drawn one above the other on the same time axis and colors, so
their lengths compare at a glance. Uses matplotlib's Agg canvas (no display,
no pyplot state): safe in worker threads and on headless machines.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from gpipe_lab.pipeline.measuring.step_timeline import Timeline

COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "R": "#8172b3", "wait": "#d9d9d9"}
LABELS = {"F": "forward", "B": "backward", "W": "weight grad", "R": "recompute",
          "wait": "wait (for a neighbour)"}
#: What the picture's two kinds of gap mean, under the time axis.
CAPTION = ("grey: the stage waits for a neighbour's activations or gradients.\n"
           "white: no action and no wait recorded: the stage has not started or has finished its part of "
           "the step, or is between two actions (hand-over, scheduling).")


def _draw(ax: Axes, timeline: Timeline, name: str, scale: float, xmax: float) -> None:
    """One Gantt panel; times in seconds from the step start, multiplied by ``scale``."""
    for e in timeline.shifted():
        x0, width = e.start * scale, max(e.duration * scale, 0.0)
        color = COLORS.get(e.kind, "#999999")
        ax.add_patch(Rectangle((x0, e.stage - 0.4), width, 0.8, facecolor=color,
                               edgecolor="white" if e.kind == "wait" else "black", linewidth=0.4))
        if e.kind != "wait" and width > 0.018 * xmax:
            ax.text(x0 + width / 2, e.stage, str(e.microbatch), ha="center", va="center", fontsize=7,
                    color="white")
    bubble = timeline.measured_bubble()
    ax.set_title(f"{name}: {timeline.wall * scale:.4g} {'ms' if scale == 1e3 else 's'}, "
                 f"bubble {bubble:.1%}", fontsize=9, loc="left")
    ax.set_yticks(range(timeline.num_stages))
    ax.set_yticklabels([f"stage {k}" for k in range(timeline.num_stages)])
    ax.set_ylim(timeline.num_stages - 0.5, -0.5)
    ax.set_xlim(0, xmax)


def plot_timeline(timeline: Timeline, path: str | Path | None = None, title: str | None = None,
                  predicted: Timeline | None = None) -> Figure:
    """Draw a measured timeline (and the predicted one below it, same scale); save a PNG if ``path``.

    Times are shown in milliseconds when the step lasts under 10 s, else in
    seconds (a simulator timeline in abstract units is shown as "s").

    Returns:
        the matplotlib ``Figure`` (e.g. for ``wandb.Image(fig)``); one axis per timeline,
        one ``Rectangle`` patch per event, the caption among the figure texts.

    Raises:
        ValueError: ``predicted`` has a different number of stages.
    """
    panels = [("measured" if predicted is not None else "timeline", timeline)]
    if predicted is not None:
        if predicted.num_stages != timeline.num_stages:
            raise ValueError(f"predicted timeline has {predicted.num_stages} stages, "
                             f"measured has {timeline.num_stages}")
        panels.append(("predicted", predicted))
    longest = max(t.wall for _, t in panels)
    scale = 1e3 if 0 < longest < 10 else 1.0
    xmax = max(longest * scale, 1e-9) * 1.02
    top, bottom = 0.75, 0.95  # inches: title and legend above, time axis and caption below
    height = top + bottom + sum(0.45 * t.num_stages + 0.45 for _, t in panels)
    fig = Figure(figsize=(11, height))
    FigureCanvasAgg(fig)
    # fixed margins, not tight_layout: laying out by measured text extents draws the figure once more
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                        gridspec_kw={"left": 0.08, "right": 0.99, "top": 1 - top / height,
                                     "bottom": bottom / height, "hspace": 0.45})[:, 0]
    for ax, (name, t) in zip(axes, panels):
        _draw(ax, t, name, scale, xmax)
    axes[-1].set_xlabel("time (ms)" if scale == 1e3 else "time")
    drawn = {e.kind for _, t in panels for e in t.events}
    handles = [Patch(facecolor=COLORS[k], edgecolor="black", label=LABELS[k]) for k in COLORS if k in drawn]
    fig.legend(handles=handles, loc="upper right", ncol=max(1, len(handles)), fontsize=8, frameon=False,
               bbox_to_anchor=(0.99, 1 - 0.3 / height))
    if title:
        fig.suptitle(title, x=0.01, y=1 - 0.08 / height, ha="left", va="top", fontsize=10)
    fig.text(0.01, 0.05 / height, CAPTION, ha="left", va="bottom", fontsize=7)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig
