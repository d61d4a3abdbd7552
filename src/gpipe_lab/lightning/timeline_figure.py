"""The pipeline timeline as a Gantt picture (the plotting package's, or a plain fallback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpipe_lab.pipeline import Timeline

_COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green", "R": "tab:purple"}


def save_timeline_figure(timeline: Timeline, path: str | Path, title: str | None = None) -> Path:
    """Draw ``timeline`` to ``path`` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure: Any
    try:
        from gpipe_lab.plotting.timeline import plot_timeline

        figure = plot_timeline(timeline, title=title)
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
