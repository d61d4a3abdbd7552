"""A stage whose forward writes into its own input (``nn.ReLU(inplace=True)`` right after a cut).

Plain PyTorch runs such a layer on a non-leaf activation. A stage's input is a leaf of
its own (its graph ends there, so each stage back-propagates alone), and autograd
refuses an in-place write into a leaf that requires grad; a checkpointed micro-batch's
first forward, which builds no graph, would write unseen into the input its
re-materialization replays from. So a stage that writes its input runs each forward:

- with a graph (a first forward or a re-materialization): on the alias of each input
  leaf (``gpipe_lab.pipeline.measuring.inplace.writable``): a non-leaf sharing the leaf's memory (no copy)
  whose gradient is the leaf's;
- a checkpointed first forward: on a copy of its inputs, so the kept ones stay as they came.

Whether a stage writes its input is learned at its first training forward, which runs
the guarded way and compares the inputs' version counters before and after. A stage
found not to write runs as before, at no cost, except that a checkpointed forward still
compares the counters (an int per input) and raises if a later forward wrote after all.
"""

from __future__ import annotations

from torch import Tensor

from gpipe_lab.pipeline.measuring.inplace import writable


class InputWrites:
    """Whether one stage's forward writes into its input: ``None`` until its first training forward."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.writes: bool | None = None

    def prepare(self, inputs: tuple[Tensor, ...], checkpointed: bool
                ) -> tuple[tuple[Tensor, ...], list[int] | None]:
        """The inputs a first forward in training runs on, and the version counters to hand to
        ``learn`` after it (``None``: nothing to learn or check)."""
        if self.writes is False:
            # a checkpointed forward would write, unseen, into what its replay reads: watch for it
            return inputs, [t._version for t in inputs] if checkpointed else None
        # the copy needs grad as the input does: the forward (without a graph) sees the same values
        run = (tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs) if checkpointed
               else writable(inputs))
        return run, [t._version for t in run] if self.writes is None else None

    def learn(self, run: tuple[Tensor, ...], versions: list[int], where: tuple[int, int]) -> None:
        """After the forward ``prepare`` prepared: learn whether it wrote its input.

        Raises:
            RuntimeError: a checkpointed forward wrote into its input after this stage's first
                training forward did not (its re-materialization would read the written values).
        """
        written = any(t._version != v for t, v in zip(run, versions))
        if self.writes is None:
            self.writes = written
        elif written:
            raise RuntimeError(
                f"stage {self.stage} wrote into its input in place (step {where[0]}, micro-batch {where[1]}), "
                "though its first training forward did not, so this checkpointed micro-batch's "
                "re-materialization would replay from the written values; make the in-place write "
                "unconditional, or out of place, or use checkpoint='never'")

    def replay_inputs(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """The inputs a re-materialization runs on (with a graph, as a first forward with one)."""
        return writable(inputs) if self.writes else inputs
