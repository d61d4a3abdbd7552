"""V-shaped schedules: two virtual stages per rank in the V placement (``placement.v_placement``).

Rank r holds stage r (chunk 0, on the way down) and stage 2K-1-r (chunk 1, on the way
back up), so the last stage sits on rank 0 beside the first and the turn at the bottom
(stage K-1 to K) stays on rank K-1 with no message. The orders follow
torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``
(phase by phase, written here over this lab's ``Action``):

* ``zb-v`` (Qi et al., arXiv 2401.10241, section 6): split backward; rank r runs
  2(K-r)-1 forwards of chunk 0, then r pairs F1/F0, then K-r rounds F1 B1 W1, then
  steady F0 B0 W0 F1 B1 W1, then a cool-down of B and the deferred W. At F = B = W these
  lists leave (K-1)/(6M+K-1) of the step idle on the simulator (the first forwards' ramp),
  about half of ZB-H1's; at most 2K micro-batch chunks alive per rank (1F1B's peak memory).
  It is built for max(M, 2K-1) micro-batches and the extra ones dropped (bubbles).
* ``dualpipev`` (DeepSeek-V3, arXiv 2412.19437): forward of one chunk paired with the
  backward of the other in the steady phase; most backwards are whole (B without W), the
  last ones split so the cool-down fills with W. Needs M >= 2K.

K=2, M=4 (``F1.3`` = forward of micro-batch 1 on stage 3; rank 0 holds stages 0 and 3)::

    zb-v       rank 0 | F0.0 F1.0 F2.0 F0.3 B0.3 W0.3 F1.3 B1.3 W1.3 F3.0 B0.0 W0.0 F2.3 B2.3 W2.3
                      | B1.0 W1.0 F3.3 B3.3 W3.3 B2.0 W2.0 B3.0 W3.0
               rank 1 | F0.1 F0.2 F1.1 F1.2 B0.2 W0.2 F2.1 B0.1 W0.1 F2.2 B1.2 W1.2 F3.1 B1.1 W1.1
                      | F3.2 B2.2 W2.2 B2.1 B3.2 B3.1 W2.1 W3.2 W3.1
    dualpipev  rank 0 | F0.0 F1.0 F2.0 F0.3 B0.3 W0.3 F1.3 F3.0 B1.3 F2.3 B0.0 B2.3 F3.3 B1.0 B3.3
                      | B2.0 W2.0 B3.0 W3.0
               rank 1 | F0.1 F0.2 F1.1 F1.2 F2.1 B0.2 F2.2 B0.1 F3.1 B1.2 F3.2 B1.1 B2.2 B2.1 B3.2
                      | B3.1 W3.2 W3.1

A ``B`` with no ``W`` of its (stage, micro-batch) is whole: it computes the weight gradients too.
"""

from __future__ import annotations

from gpipe_lab.pipeline.schedules.actions import Action, ActionKind, Schedule, check_sizes


class _RankList:
    """One rank's list under construction: per (stage, kind) the next micro-batch, and the W queue."""

    def __init__(self, first: int, second: int, limit: int) -> None:
        self.stages = (first, second)
        self.limit = limit  # actions of micro-batches >= limit are dropped (zb-v's padding)
        self.actions: list[Action] = []
        self.count: dict[tuple[int, str], int] = {}
        self.pending_w: list[tuple[int, int]] = []

    def add(self, chunk: int, kind: ActionKind, split: bool = True) -> None:
        """The next ``kind`` of ``chunk``; a split ``B`` queues its ``W``, a whole one counts it done."""
        stage = self.stages[chunk]
        mb = self.count.get((stage, kind), 0)
        self.count[(stage, kind)] = mb + 1
        if kind == "B" and split:
            self.pending_w.append((stage, mb))
        if mb < self.limit:
            self.actions.append(Action(stage, kind, mb))

    def next_w(self) -> None:
        """The oldest queued ``W`` (none queued: nothing)."""
        if self.pending_w:
            stage, mb = self.pending_w.pop(0)
            if mb < self.limit:
                self.actions.append(Action(stage, "W", mb))


def zb_v_schedule(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """ZB-V: zero-bubble split backward over the V placement (two stages per rank).

    Raises:
        ValueError: a size below 1, or ``virtual_stages`` other than 2.
    """
    check_sizes(num_ranks, num_microbatches, virtual_stages)
    _two_chunks("zb-v", virtual_stages)
    K, M = num_ranks, num_microbatches
    n = max(2 * K - 1, M)
    schedule: Schedule = []
    for r in range(K):
        rank = _RankList(r, 2 * K - 1 - r, M)
        for _ in range(2 * (K - r) - 1):
            rank.add(0, "F")
        for _ in range(r):
            rank.add(1, "F")
            rank.add(0, "F")
        for _ in range(K - r):
            rank.add(1, "F")
            rank.add(1, "B")
            rank.next_w()
        while rank.count.get((rank.stages[1], "F"), 0) < rank.count[(rank.stages[0], "F")] or \
                rank.count[(rank.stages[0], "F")] < n:
            if rank.count[(rank.stages[0], "F")] < n:
                rank.add(0, "F")
            rank.add(0, "B")
            rank.next_w()
            rank.add(1, "F")
            rank.add(1, "B")
            rank.next_w()
        for _ in range(r):
            rank.add(0, "B")
            rank.add(1, "B")
        for _ in range(K - r):
            rank.add(0, "B")
            rank.next_w()
        while rank.pending_w:
            rank.next_w()
        schedule.append(rank.actions)
    return schedule


def dualpipe_v_schedule(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """DualPipeV: the V half of DualPipe, whole backwards paired with forwards, split ones at the end.

    Raises:
        ValueError: a size below 1, ``virtual_stages`` other than 2, or M < 2K (the message
            names both).
    """
    check_sizes(num_ranks, num_microbatches, virtual_stages)
    _two_chunks("dualpipev", virtual_stages)
    K, M = num_ranks, num_microbatches
    if M < 2 * K:
        raise ValueError(f"dualpipev needs at least 2K = {2 * K} micro-batches (chunks) with K={K} ranks, "
                         f"got {M}")
    schedule: Schedule = []
    for r in range(K):
        rank = _RankList(r, 2 * K - 1 - r, M)
        for _ in range(2 * (K - r - 1)):
            rank.add(0, "F")
        for _ in range(r + 1):
            rank.add(0, "F")
            rank.add(1, "F")
        for _ in range(K - r - 1):
            rank.add(1, "B")
            rank.next_w()
            rank.add(1, "F")
        for _ in range(M - 2 * K + r + 1):  # the steady phase: F of one chunk beside B of the other
            rank.add(0, "F")
            rank.add(1, "B", split=False)
            rank.add(1, "F")
            rank.add(0, "B", split=False)
        for _ in range(K - r - 1):
            rank.add(1, "B", split=False)
            rank.add(1, "F")
            rank.add(0, "B", split=False)
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            rank.add(1, "B", split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            rank.add(0, "B", split)
        for _ in range(K - r - 1):
            rank.next_w()
            rank.add(0, "B", split)
        while rank.pending_w:
            rank.next_w()
        schedule.append(rank.actions)
    return schedule


def _two_chunks(name: str, virtual_stages: int) -> None:
    if virtual_stages != 2:
        raise ValueError(f"schedule {name!r} runs with virtual_stages=2 (two stages per rank in a V), "
                         f"got virtual_stages={virtual_stages}")
