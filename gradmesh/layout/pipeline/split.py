"""A stage's backward in two parts, for the zero-bubble schedules (`zero_bubble`): B, the
gradients of the stage's inputs, which the stage before waits for, and W, the gradients of its
weights, which can wait.

B runs autograd from the stage's outputs to its inputs only (`torch.autograd.grad`, keeping the
graph): the engine then computes, in every node, only the outputs that lead to an input, so a
linear layer's input gradient is computed and its weight gradient is not. Before that, each
node on the way to an input that also leads to weights only (a matmul, a norm, an embedding
sum: a "split node") gets a hook that keeps the gradient it receives. W then runs each split
node again from that gradient towards its weights only (`torch.autograd.backward` from the
node's gradient edges, `inputs=` its weights), which computes just the outputs the weights need
and accumulates into `.grad` as a whole backward does, so gradient hooks (the data-parallel
reducer's, the expert and sequence-parallel scalings) fire at W, when a weight's gradient is
final. Hooks on a split node's output tensors run again when W runs the node (their side
effects twice); a pre-hook of W's own gives the node what B gave it, so a hook that changes a
gradient changes it once. Outputs whose whole graph leads to weights only (the first stage,
which takes integer tokens) are W roots as they are. A weight used twice in one stage
(autograd sums what reaches it over both uses, so one split node's rerun would count the
other's) makes that stage's W a whole backward restricted to its weights: correct, at the cost
of the input gradients computed again. The saved tensors live until W (the graph is kept for
it) and go with it.

Why not `torch.distributed.pipelining`'s split backward: it is coupled to its own stage and
schedule classes; this one works on any graph gradmesh's stages build (layer sequences, graph
cuts, tensor-parallel layers). A custom autograd function that both leads to an input and uses
a weight directly cannot run half of its backward (its `backward` computes every gradient, and
may communicate): such a stage is refused in one line naming the function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from gradmesh.errors import GradmeshError


@dataclass
class _SplitNode:
    """One split node: the gradients it received in B and the weights its weight-only edges
    lead to."""

    node: Node
    grads: list[torch.Tensor | None]
    weights: list[torch.Tensor]


@dataclass
class WeightWork:
    """What a B left for its W: the split nodes and the outputs whose graph reaches weights
    only; or, where a weight is used twice in the stage (`again`), the stage's outputs with
    their gradients and its weights."""

    nodes: list[_SplitNode] = field(default_factory=list)
    roots: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    again: tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor]] | None = None

    def run(self) -> None:
        """The weights' gradients, accumulated into `.grad` (W); the graph goes with it."""
        if self.again is not None:
            outs, grads, weights = self.again
            torch.autograd.backward(outs, grads, inputs=weights)
        for split in self.nodes:
            kept = [(GradientEdge(split.node, k), g) for k, g in enumerate(split.grads)]
            kept = [(e, g) for e, g in kept if g is not None]
            if kept and split.weights:  # its input's gradient is not computed again
                # what B gave the node, again: not what hooks on its outputs (which run again
                # as the node does) would make of it a second time
                hook = split.node.register_prehook(lambda _g, s=split: tuple(s.grads))
                try:
                    torch.autograd.backward(
                        [e for e, _ in kept], [g for _, g in kept], inputs=split.weights
                    )
                finally:
                    hook.remove()
        if self.roots:
            torch.autograd.backward([o for o, _ in self.roots], [g for _, g in self.roots])
        self.nodes, self.roots, self.again = [], [], None


def backward_input(
    outs: list[torch.Tensor], grads: list[torch.Tensor] | None, ins: list[torch.Tensor]
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: the gradients of `ins` (None where an input takes none) from `outs` and their `grads`
    (None: `outs` is a scalar loss), and the W that is left (`WeightWork.run`)."""
    wanted = [v for v in ins if v.requires_grad]
    graph = _Graph(outs, [get_gradient_edge(v).node for v in wanted])
    work = WeightWork()
    hooks, splits = [], []
    for node in graph.split:
        slot: list[torch.Tensor | None] = []
        splits.append(_SplitNode(node, slot, graph.weights_of(node)))
        hooks.append(node.register_prehook(lambda g, slot=slot: slot.extend(g)))
    given = grads if grads is not None else [None] * len(outs)
    for out, grad in zip(outs, given, strict=True):
        if out.grad_fn is not None and out.grad_fn not in graph.to_input:
            work.roots.append((out, grad))
    try:
        found = (
            torch.autograd.grad(
                outs, wanted, grads, retain_graph=True, allow_unused=True, materialize_grads=True
            )
            if wanted
            else ()
        )
    finally:
        for hook in hooks:
            hook.remove()
    uses = [w for split in splits for w in split.weights]
    roots = [out.grad_fn for out, _ in work.roots if out.grad_fn is not None]
    uses += [w for root in roots for w in graph.weights_below(root)]
    if len({id(w) for w in uses}) < len(uses):  # a weight used twice: W is a whole backward
        weights = list({id(w): w for w in uses}.values())
        return _by_input(ins, wanted, found), WeightWork(again=(outs, grads, weights))
    work.nodes = splits
    return _by_input(ins, wanted, found), work


def _by_input(
    ins: list[torch.Tensor], wanted: list[torch.Tensor], found: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    by_input = dict(zip(map(id, wanted), found, strict=True))
    return [by_input.get(id(v)) for v in ins]


class _Graph:
    """The autograd graph behind `outs`: which nodes lead to the stage's inputs (`to_input`),
    which lead to weights only (`weight_only`), and the nodes of the first kind with an edge to
    the second (`split`)."""

    def __init__(self, outs: list[torch.Tensor], inputs: list[Node]) -> None:
        roots = [o.grad_fn for o in outs if o.grad_fn is not None]
        self.children: dict[Node, list[Node]] = {}
        order: list[Node] = []  # children before parents
        stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if node in self.children:
                continue
            kids = [child for child, _ in node.next_functions if child is not None]
            self.children[node] = kids
            stack.append((node, True))
            stack.extend((kid, False) for kid in kids if kid not in self.children)
        targets = set(inputs)
        self.to_input: set[Node] = set()
        for node in order:
            if node in targets or any(k in self.to_input for k in self.children[node]):
                self.to_input.add(node)
        self.weight_only = set(self.children) - self.to_input
        self.split = [
            n
            for n in order
            if n in self.to_input
            and n not in targets
            and any(k in self.weight_only for k in self.children[n])
        ]
        for node in self.split:
            if isinstance(node, BackwardCFunction):
                raise GradmeshError(
                    f"a pipeline stage's custom autograd function {node.name()} both passes "
                    "gradients to the stage's input and computes a weight's gradient, and it "
                    "cannot run the two apart: use a schedule that does not split backward "
                    "(1f1b, interleaved, gpipe)"
                )

    def weights_of(self, node: Node) -> list[torch.Tensor]:
        """The weights `node` reaches by its weight-only edges."""
        found: dict[int, torch.Tensor] = {}
        for kid in self.children[node]:
            if kid in self.weight_only:
                found.update((id(w), w) for w in self.weights_below(kid))
        return list(found.values())

    def weights_below(self, node: Node) -> list[torch.Tensor]:
        """The weights (leaves) behind a node of the weight-only part."""
        found: dict[int, torch.Tensor] = {}
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            variable: Any = getattr(n, "variable", None)
            if variable is not None:
                found[id(variable)] = variable
            stack.extend(self.children[n])
        return list(found.values())


def check_splittable(model: torch.nn.Module, run: Any) -> None:
    """One line, before launch, if a layer of `model` that holds weights runs a custom autograd
    function a zero-bubble schedule cannot split: each such layer is run again alone on what
    entered it during `run()` (a forward of the whole model on a sample), its input a leaf, and
    its graph read as a stage's would be. A function used outside such layers is found at the
    first backward instead."""
    seen: list[tuple[torch.nn.Module, tuple[Any, ...]]] = []

    def keep(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        seen.append((module, args))

    layers = [
        m
        for m in model.modules()
        if not list(m.children()) and any(True for _ in m.parameters(recurse=False))
    ]
    hooks = [m.register_forward_pre_hook(keep) for m in layers]
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    for module, args in seen:
        ins = [
            a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
            for a in args
        ]
        out = module(*ins)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(o)]
        leaves = [a for a in ins if torch.is_tensor(a) and a.requires_grad]
        if leaves and any(o.requires_grad for o in outs):
            _Graph(
                [o for o in outs if o.requires_grad], [get_gradient_edge(a).node for a in leaves]
            )
