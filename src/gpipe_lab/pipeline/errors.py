"""Errors of the pipeline, and how a stage's exception reaches the caller."""

from __future__ import annotations

from collections.abc import Sequence

from gpipe_lab.pipeline.schedules import Action


def describe(stage: int, action: Action | None) -> str:
    if action is None:
        return f"stage {stage}"
    names = {"F": "forward", "B": "backward", "W": "weight gradient"}
    return f"stage {stage}, {names.get(action.kind, action.kind)} of micro-batch {action.microbatch}"


def annotate(exc: BaseException, stage: int, action: Action | None) -> BaseException:
    """Add where an exception happened to its message, keeping its type.

    The text is appended to a string first argument (so ``str(exc)`` shows it)
    and also attached as a note.
    """
    where = f"[in {describe(stage, action)}]"
    if exc.args and isinstance(exc.args[0], str) and where not in exc.args[0]:
        exc.args = (f"{exc.args[0]} {where}",) + tuple(exc.args[1:])
    elif not exc.args:
        exc.args = (where,)
    if hasattr(exc, "add_note"):
        exc.add_note(f"GPipe: raised {where}")
    # attributes any exception can take (``BaseException`` declares none)
    exc.__dict__.update(gpipe_stage=stage, gpipe_microbatch=None if action is None else action.microbatch)
    return exc


class PipelineTimeoutError(TimeoutError):
    """A wait lasted longer than the timeout (a limit per wait, not per step): a stage's wait for
    a neighbour, or the caller's wait for stages none of which progressed. The message holds
    every stage's schedule position."""

    def __init__(self, timeout: float, done: Sequence[Action | None],
                 waiting: Sequence[Action | None], what: str = "a stage waited for a neighbour") -> None:
        lines = [
            f"  stage {k}: last completed {done[k] or 'nothing'}, waiting on {waiting[k] or 'nothing (finished)'}"
            for k in range(len(done))
        ]
        super().__init__(f"{what} longer than the timeout of {timeout:g} s; schedule state:\n"
                         + "\n".join(lines))
        self.done = list(done)
        self.waiting = list(waiting)
