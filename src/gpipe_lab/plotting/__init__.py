"""Pictures of pipeline steps (matplotlib, Agg): the measured timeline beside the predicted one."""

from gpipe_lab.plotting.timeline import COLORS, plot_timeline

__all__ = ["COLORS", "plot_timeline"]
