"""The pipeline timeline as a Gantt picture: the measured step above the step the simulator
predicts for the same schedule from that step's own action times (the plotting package's
figure)."""

from __future__ import annotations

from pathlib import Path

from gpipe_lab.pipeline import Timeline, get_schedule


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
    from gpipe_lab.plotting.timeline import plot_timeline  # matplotlib: loaded when first drawn

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # plot_timeline draws on its own Agg canvas (no pyplot state to close) and lays itself out
    plot_timeline(timeline, title=title, predicted=predicted).savefig(path, dpi=100)
    return path
