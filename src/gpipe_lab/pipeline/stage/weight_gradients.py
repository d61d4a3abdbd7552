"""Split backward: input gradients now (B), weight gradients later (W), without redoing B.

Zero-bubble schedules (Qi et al., arXiv 2401.10241) let a stage send the
gradient of its input to the previous stage as soon as possible and compute
its weight gradients later, in what would otherwise be a bubble.

How the split is cut, on the stage's autograd graph (no forward hooks needed):

* ``R`` = the graph nodes from which a stage input (a leaf that requires grad)
  can be reached. B must run exactly these nodes.
* A *mixed* node is a node of ``R`` with a child outside ``R`` that leads to a
  parameter: e.g. ``AddmmBackward`` of ``nn.Linear`` (input side in ``R``,
  weight and bias outside), ``ConvolutionBackward``.
* B calls ``torch.autograd.grad`` with the stage inputs AND the gradient edges
  of every mixed node (the gradient of that node's forward output, i.e. the
  layer's ``grad_output``) as ``inputs``. The engine then skips every
  weight-side output: the weight matmuls are not computed in B.
* W runs, per mixed node, ``torch.autograd.backward`` from that node's edges
  with the captured gradients and ``inputs`` = only the parameters it feeds.
  The input side of the node leads to no requested parameter, so the engine
  runs that one node (weight-side outputs only) and its parameter chain: W
  costs the weight gradients, nothing more.

When the cut is not sound (a parameter reached both from a node's weight side
and its input side, e.g. weights tied inside a stage, or an output that does
not depend on the input), ``plan_split`` returns ``None`` and the caller falls
back to the generic path (W re-traverses the graph with ``inputs=params``),
which is exact but repeats B's work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from gpipe_lab.pipeline.stage.linear_weights import linear_weight_grads


@dataclass
class WeightTask:
    """One mixed node's deferred weight work: its output edges, their gradients, its parameters."""

    edges: list[GradientEdge]
    params: list[Tensor]
    grads: list[Tensor | None]


@dataclass
class SplitPlan:
    """What B must capture so that W is cheap."""

    tasks: list[WeightTask]

    def capture_edges(self) -> list[GradientEdge]:
        return [e for t in self.tasks for e in t.edges]


def _children(node: Node) -> list[tuple[Node, int]]:
    return [(n, i) for n, i in node.next_functions if n is not None]


def _reachability(roots: list[Tensor], inputs: list[Tensor], params: Sequence[Tensor]
                  ) -> tuple[dict[Node, bool], dict[Node, int], dict[Node, set[int]]]:
    """One post-order walk of the graph behind ``roots``: for each node, whether it reaches a stage
    input, the bitset of parameters it reaches, and the output slots its parents read."""
    root_nodes = cast("list[Node]", [r.grad_fn for r in roots])  # plan_split's check: none is None
    input_ids = {id(t) for t in inputs}
    param_index = {id(p): j for j, p in enumerate(params)}
    # Iterative post-order over the graph: reach_in[node], reach_params[node] (bitset).
    reach_in: dict[Node, bool] = {}
    reach_params: dict[Node, int] = {}
    parents_slots: dict[Node, set[int]] = {}
    for r, n in zip(roots, root_nodes):
        parents_slots.setdefault(n, set()).add(r.output_nr)
    stack: list[tuple[Node, bool]] = [(n, False) for n in root_nodes]
    while stack:
        node, expanded = stack.pop()
        if node in reach_in:
            continue
        if hasattr(node, "variable"):  # AccumulateGrad of a leaf
            var = node.variable
            reach_in[node] = id(var) in input_ids
            j = param_index.get(id(var))
            reach_params[node] = 0 if j is None else 1 << j
            continue
        kids = _children(node)
        if not expanded:
            stack.append((node, True))
            for child, slot in kids:
                parents_slots.setdefault(child, set()).add(slot)
                if child not in reach_in:
                    stack.append((child, False))
            continue
        reach_in[node] = any(reach_in[c] for c, _ in kids)
        bits = 0
        for c, _ in kids:
            bits |= reach_params[c]
        reach_params[node] = bits
    return reach_in, reach_params, parents_slots


def plan_split(roots: list[Tensor], inputs: list[Tensor], params: Sequence[Tensor]) -> SplitPlan | None:
    """Find the mixed nodes of the graph behind ``roots``.

    Returns ``None`` when the cheap split is not sound for this graph (see the
    module docstring) or when no stage input requires grad (then B has nothing
    to compute and W is a plain backward).
    """
    root_nodes = [n for r in roots if (n := r.grad_fn) is not None]
    if not inputs or len(root_nodes) < len(roots):
        return None
    reach_in, reach_params, parents_slots = _reachability(roots, inputs, params)
    if not all(reach_in[n] for n in root_nodes):
        return None
    tasks: list[WeightTask] = []
    covered = 0
    for node, into_input in reach_in.items():
        if not into_input or hasattr(node, "variable"):
            continue
        kids = _children(node)
        weight_bits = 0
        input_bits = 0
        for c, _ in kids:
            if reach_in[c]:
                input_bits |= reach_params[c]
            else:
                weight_bits |= reach_params[c]
        if not weight_bits:
            continue
        if weight_bits & input_bits or weight_bits & covered:
            return None  # tied parameters: the per-node W would count a path twice
        covered |= weight_bits
        node_params = [p for j, p in enumerate(params) if weight_bits >> j & 1]
        edges = [GradientEdge(node, s) for s in sorted(parents_slots.get(node, {0}))]
        tasks.append(WeightTask(edges, node_params, [None] * len(edges)))
    all_bits = 0
    for n in root_nodes:
        all_bits |= reach_params[n]
    if covered != all_bits:
        return None
    return SplitPlan(tasks)


def input_backward(plan: SplitPlan, roots: list[Tensor], grad_roots: list[Tensor] | None,
                   inputs: list[Tensor], want_inputs: bool = True) -> list[Tensor | None]:
    """B: gradients of the stage inputs; stores each mixed node's ``grad_output`` in ``plan``.

    With ``want_inputs=False`` (the first stage, whose input only marks where the graph
    ends) the input gradients are not computed: ``None`` for each.
    """
    edges = plan.capture_edges()
    if not want_inputs:
        inputs = []
    if not inputs and not edges:
        return []  # a stage with nothing to train and no input gradient wanted: B finds nothing
    # torch's stub takes tensors or edges, not a mix; autograd.grad takes both in one list
    found = torch.autograd.grad(roots, [*inputs, *edges], grad_roots, retain_graph=True,  # type: ignore[arg-type]
                                allow_unused=True)
    rest: list[Tensor | None] = list(found[len(inputs):])  # allow_unused: None where none reached
    for task in plan.tasks:
        task.grads, rest = rest[:len(task.edges)], rest[len(task.edges):]
    return list(found[:len(inputs)])


def backward_into(roots: Sequence[Tensor | GradientEdge], grads: Sequence[Tensor] | None,
                  params: Sequence[Tensor], retain_graph: bool = False) -> None:
    """``torch.autograd.backward(roots, grads, inputs=params)``, for W: no parameter keeps a ``.grad``
    that shares memory with ``grads``.

    A parameter whose ``.grad`` is None adopts the gradient reaching it when nothing else holds
    that tensor, and a view (a slice of a concatenation, a broadcast that sums nothing with
    one-sample micro-batches) counts as held by nothing. Plain autograd's gradients are its own
    and die with the backward; W's are B's captured ones, which alias one another (an addition
    hands the same tensor to both sides) and the gradient sent upstream. The parameter's next
    accumulation, in place, would then write into a gradient another W or stage still reads.
    Such an adopted ``.grad`` is copied once, the copy autograd makes when it cannot adopt.
    """
    fresh = [p for p in params if p.grad is None]
    # torch's stub takes tensors or edges as roots, not a mix; autograd.backward takes both
    torch.autograd.backward(roots, grads, retain_graph=retain_graph, inputs=list(params))  # type: ignore[arg-type]
    if fresh and grads:
        fed = {g.untyped_storage().data_ptr() for g in grads if g.layout == torch.strided}
        for p in fresh:
            g = p.grad
            if g is not None and g.layout == torch.strided and g.untyped_storage().data_ptr() in fed:
                p.grad = g.clone()


def task_weight_backward(task: WeightTask) -> None:
    """W of one mixed node: its weight-side outputs only, from the ``grad_output`` B captured."""
    pairs = [(e, g) for e, g in zip(task.edges, task.grads) if g is not None]
    if len(pairs) == 1 and linear_weight_grads([pairs[0][0].node], [pairs[0][1]], task.params):
        pass
    elif pairs:
        backward_into([e for e, _ in pairs], [g for _, g in pairs], task.params, retain_graph=True)
    task.grads = []


def split_weight_backward(plan: SplitPlan) -> None:
    """W: accumulate each mixed node's weight gradients into ``.grad`` (only its own parameters)."""
    for task in plan.tasks:
        task_weight_backward(task)


def batched_weight_backward(plans: list[SplitPlan]) -> None:
    """W of several micro-batches at once: one GEMM per ``nn.Linear`` over all their rows.

    Micro-batching makes every weight-gradient GEMM short (its inner dimension is the
    micro-batch); stacking the micro-batches gives the full batch's GEMM back. Layers
    that are not plain ``nn.Linear`` (or whose graphs differ between micro-batches) run
    per micro-batch as in ``split_weight_backward``.
    """
    if len({len(p.tasks) for p in plans}) != 1:
        for plan in plans:
            split_weight_backward(plan)
        return
    for column in zip(*(p.tasks for p in plans)):
        single = [t.grads[0] if len(t.edges) == 1 and len(t.grads) == 1 else None for t in column]
        same_params = all([id(p) for p in t.params] == [id(p) for p in column[0].params] for t in column)
        if same_params and all(g is not None for g in single) and linear_weight_grads(
                [t.edges[0].node for t in column], cast("list[Tensor]", single), column[0].params):
            for task in column:
                task.grads = []
            continue
        for task in column:
            task_weight_backward(task)

