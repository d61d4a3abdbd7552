"""The pipeline timeline as a Gantt picture: the measured step above the step the simulator
predicts for the same schedule from that step's own action times (the plotting package's
figure, or a plain fallback without the prediction)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpipe_lab.pipeline import Timeline, get_schedule

_COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green", "R": "tab:purple"}


def predicted_timeline(measured: Timeline, schedule: str, chunks: int, checkpoint: str) -> Timeline | None:
    """The simulator's step for ``schedule`` with ``measured``'s median action times; ``None`` when
    the schedule's stages are not the timeline's (e.g. virtual stages).

    A stage whose measured step has no weight-gradient (W) action ran full backwards: half of one
    counts as W, so that a schedule with W actions (zb-h1) still shows them.
    """
    from gpipe_lab.planner import costs_from_timeline, predict_step

    try:
        actions = get_schedule(schedule, measured.num_stages, chunks)
        replayed = {"always": range(chunks), "except_last": range(chunks - 1)}.get(checkpoint, ())
        predicted = predict_step(actions, costs_from_timeline(measured, weight_share=0.5), replayed).timeline
    except ValueError:
        return None
    return predicted if predicted.num_stages == measured.num_stages else None


def save_timeline_figure(timeline: Timeline, path: str | Path, title: str | None = None,
                         predicted: Timeline | None = None) -> Path:
    """Draw ``timeline`` (and ``predicted`` below it) to ``path`` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure: Any
    try:
        from gpipe_lab.plotting.timeline import plot_timeline

        figure = plot_timeline(timeline, title=title, predicted=predicted)
    except ImportError:
        figure, ax = plt.subplots(figsize=(10, 0.6 * timeline.num_stages + 1.2))
        for e in timeline.shifted():
            if e.kind in _COLORS:
                ax.barh(e.stage, e.duration, left=e.start, color=_COLORS[e.kind], edgecolor="black", linewidth=0.3)
                ax.text(e.start + e.duration / 2, e.stage, f"{e.kind}{e.microbatch}", ha="center",
                        va="center", fontsize=6)
        ax.set_yticks(range(timeline.num_stages))
        ax.set_yticklabels([f"stage {k}" for k in range(timeline.num_stages)])
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.set_title(title or f"bubble {timeline.measured_bubble():.2f}")
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return path
