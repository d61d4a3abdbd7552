"""The engine's stage threads as tests see them: long-lived workers, busy while they run a step."""

from __future__ import annotations

import threading

from gpipe_lab.pipeline.step.workers import StageWorker


def busy_stage_threads() -> list[StageWorker]:
    """Stage workers (every pipe's) running a task now."""
    return [t for t in threading.enumerate() if isinstance(t, StageWorker) and not t.idle.is_set()]


def wait_for_stage_threads(limit: float = 30.0) -> None:
    """Block (at most ``limit`` seconds each) until every other stage worker is idle."""
    for t in busy_stage_threads():
        if t is not threading.current_thread():
            t.idle.wait(limit)
