"""Skip tensors on the move: one message per (stash stage, pop stage) pair and micro-batch.

A stage's skips travel as extra boundary values of the stage (``StageRuntime`` sees its
popped skips as extra inputs and its stashed ones as extra outputs), but each group goes
straight between the two stages that use it, never through the stages in between:

* ``F`` of the stash stage sends ``("SF<src>", dst, mb)`` to the pop stage; ``F`` of the pop
  stage receives it beside its activation;
* ``B`` of the pop stage sends the gradients of those inputs back as ``("SB<dst>", src, mb)``;
  ``B`` of the stash stage receives them beside its output gradient.

A schedule runs the pop stage's ``F`` after the stash stage's (through the stages between) and
the stash stage's ``B`` after the pop stage's, so skip messages add no new wait to any schedule.
The distributed transport gives each (stash stage, pop stage) pair a link of its own per
direction (``skip_links``), so each link carries its messages in micro-batch order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from gpipe_lab.pipeline.schedules import Action, MessageKey, Schedule, placement_of
from gpipe_lab.pipeline.skip.layout import Group, SkipLayout, StageSkips

Values = tuple[Tensor | None, ...]
Receive = Callable[[MessageKey, Action], tuple[Values, bool]]
Send = Callable[[MessageKey, Values], None]


def forward_key(src: int, dst: int, mb: int) -> MessageKey:
    return (f"SF{src}", dst, mb)


def backward_key(dst: int, src: int, mb: int) -> MessageKey:
    return (f"SB{dst}", src, mb)


def _message(key: MessageKey) -> tuple[str, str]:
    """(the link kind a message travels on, what it carries)."""
    kind = key[0]
    if kind[:2] in ("SF", "SB"):
        forward, other = kind[1] == "F", kind[2:]
        return (f"{'skip' if forward else 'skipgrad'}{other}>{key[1]}",
                f"skip {'tensors' if forward else 'gradients'} from stage {other}")
    return ("act", "activation") if kind == "F" else ("grad", "gradient")


def link_kind(key: MessageKey) -> str:
    """The link kind a message travels on: ``act``, ``grad``, or for a skip between stages s and t
    ``skip<s>><t>`` (stashed tensors) / ``skipgrad<t>><s>`` (their gradients)."""
    return _message(key)[0]


def message_name(key: MessageKey) -> str:
    """What a message carries, for errors: ``activation``, ``gradient``, ``skip tensors from stage 0`` ..."""
    return _message(key)[1]


def _receive_groups(groups: Sequence[Group], key: Callable[[int], MessageKey], action: Action,
                    receive: Receive) -> Values:
    values: Values = ()
    for other, _ in groups:
        values += receive(key(other), action)[0]
    return values


def _send_groups(groups: Sequence[Group], values: Values, key: Callable[[int], MessageKey], send: Send) -> Values:
    """Send the tail of ``values`` group by group; returns the head (the boundary values)."""
    n = sum(len(names) for _, names in groups)
    head, tail = values[:len(values) - n], values[len(values) - n:]
    at = 0
    for other, names in groups:
        send(key(other), tail[at:at + len(names)])
        at += len(names)
    return head


def receive_skips(skips: StageSkips, action: Action, receive: Receive) -> Values:
    """``F``: the skip tensors popped on this stage, in ``inbound`` order."""
    mb, j = action.microbatch, skips.stage
    return _receive_groups(skips.inbound, lambda src: forward_key(src, j, mb), action, receive)


def send_skips(skips: StageSkips, mb: int, outputs: Values, send: Send) -> Values:
    """``F``: send the stashed tensors (the tail of ``outputs``) to their pop stages; returns the
    stage's boundary outputs."""
    j = skips.stage
    return _send_groups(skips.outbound, outputs, lambda dst: forward_key(j, dst, mb), send)


def receive_skip_gradients(skips: StageSkips, action: Action, receive: Receive) -> Values:
    """``B``: the gradients of this stage's stashed tensors, in ``outbound`` order."""
    mb, j = action.microbatch, skips.stage
    return _receive_groups(skips.outbound, lambda dst: backward_key(dst, j, mb), action, receive)


def send_skip_gradients(skips: StageSkips, mb: int, grads: Values, send: Send) -> Values:
    """``B``: send the gradients of the popped tensors (the tail of ``grads``) back to their stash
    stages; returns the gradients of the stage's boundary inputs."""
    j = skips.stage
    return _send_groups(skips.inbound, grads, lambda src: backward_key(j, src, mb), send)


Messages = list[tuple[int, int, MessageKey]]  # (sending rank, receiving rank, key)


def skip_messages(schedule: Schedule, stages: Mapping[int, StageSkips | None]) -> tuple[Messages, Messages]:
    """The skip messages of the actions of ``stages`` (stage -> its skips): once in the order each
    sender produces them, once in the order each receiver consumes them."""
    rank = placement_of(schedule)  # each stage's rank, read from the lists
    sent: list[tuple[int, int, MessageKey]] = []
    consumed: list[tuple[int, int, MessageKey]] = []
    for k, actions in enumerate(schedule):
        for a in actions:
            mine = stages.get(a.stage)
            if mine is None or a.kind not in "FB":
                continue
            j, mb = a.stage, a.microbatch
            if a.kind == "F":
                sent += [(k, rank[dst], forward_key(j, dst, mb)) for dst, _ in mine.outbound]
                consumed += [(rank[src], k, forward_key(src, j, mb)) for src, _ in mine.inbound]
            else:
                sent += [(k, rank[src], backward_key(j, src, mb)) for src, _ in mine.inbound]
                consumed += [(rank[dst], k, backward_key(dst, j, mb)) for dst, _ in mine.outbound]
    return sent, consumed


def skip_senders(schedule: Schedule, runtimes: Mapping[int, Any]) -> dict[MessageKey, int]:
    """The rank that sends each skip message the hosted stage ``runtimes`` consume (the executor
    names it when a wait times out)."""
    stages = {j: r.skips for j, r in runtimes.items() if r.skips is not None}
    return {key: src for src, _, key in skip_messages(schedule, stages)[1]} if stages else {}


def skip_link_plan(schedule: Schedule, layout: SkipLayout | None,
                   pp_ranks: Sequence[int]) -> dict[tuple[str, int, int], list[MessageKey]]:
    """The ordered skip messages of every link between two ranks (global ranks), as
    ``links.message_plan`` gives the activations' and gradients'.

    Raises:
        ValueError: a link whose sender produces its messages in another order than its receiver
            consumes them.
    """
    if layout is None:
        return {}
    sent, consumed = skip_messages(schedule, {j: layout.stage(j) for j in range(layout.num_stages)})

    def by_link(messages: Messages) -> dict[tuple[str, int, int], list[MessageKey]]:
        out: dict[tuple[str, int, int], list[MessageKey]] = {}
        for src, dst, key in messages:
            if src != dst:
                out.setdefault((link_kind(key), pp_ranks[src], pp_ranks[dst]), []).append(key)
        return out

    plan, wanted = by_link(sent), by_link(consumed)
    for link in sorted(set(plan) | set(wanted)):
        if plan.get(link) != wanted.get(link):
            raise ValueError(f"skip link {link}: sent in order {plan.get(link)} but consumed in order "
                             f"{wanted.get(link)}; this schedule cannot carry these skips between ranks")
    return plan


def skip_links(layout: SkipLayout, placement: Sequence[int]) -> list[tuple[str, int, int]]:
    """The rank-level edges (kind, from rank, to rank) the skips need, beside a pipeline's own
    (``placement``: the pipeline rank of each stage, the schedule's)."""
    edges: list[tuple[str, int, int]] = []
    for src, dst in layout.pairs():
        a, b = placement[src], placement[dst]
        if a != b:
            edges += [(link_kind(forward_key(src, dst, 0)), a, b), (link_kind(backward_key(dst, src, 0)), b, a)]
    return edges


def attach(runtimes: Mapping[int, Any], layout: SkipLayout) -> None:
    """Give each hosted stage runtime its ``StageSkips`` (``None``: no skip crosses its boundary)."""
    for j, runtime in runtimes.items():
        runtime.skips = layout.stage(j)
