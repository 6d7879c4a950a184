"""What crosses each cut of a model split on its graph, and where each stage's arguments come
from.

torch's split (`torch.distributed.pipelining.pipeline`) hands a stage its arguments straight
from wherever they were made: the model's own inputs (an attention mask first used three stages
down), the previous stage's outputs, or the outputs of any earlier stage (a value made in stage
0 and next used in stage 2 skips stage 1). gradmesh's stages talk to their neighbours only, so
each cut carries every value made before it that a later stage needs (a stage passes on what it
received but does not use), and a model input a later stage needs is read from the micro-batch
there (every rank of a pipeline holds the batch), never sent. The routes are read off the split's
top-level graph once per trace.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from gradmesh.data.batch import Batch, arguments
from gradmesh.errors import GradmeshError

Key = tuple[str, int, int]
"""A value: ("root", input index, 0) for the model's input, ("out", stage, index) for a stage's
output (index -1: the stage's whole output, a single tensor)."""


@dataclass
class Routes:
    sources: list[list[Key]]
    """Each stage's arguments, in order."""
    carried: list[list[Key]]
    """What each cut (after stage k) carries, in order."""
    inputs: list[str]
    """The model's inputs as the graph names them (keyword names for a dict batch)."""

    def model_inputs(self, part: Batch) -> list[torch.Tensor]:
        """The micro-batch's tensors in the graph's order of the model's inputs."""
        if isinstance(part, dict):
            return [part[name] for name in self.inputs]
        args, _ = arguments(part)
        return list(args)

    def run(self, k: int, stage: Any, incoming: list[torch.Tensor], part: Batch) -> Any:
        """Stage k on what its cut brought (`incoming`, as `carried[k - 1]` lists it) and on
        the micro-batch; returns what the next cut carries, or the model's output from the last
        stage."""
        known = dict(zip(self.carried[k - 1], incoming, strict=True)) if k else {}
        roots = self.model_inputs(part) if any(s[0] == "root" for s in self.sources[k]) else []
        args = [roots[s[1]] if s[0] == "root" else known[s] for s in self.sources[k]]
        out = stage(*args)
        if k == len(self.sources) - 1:
            return out
        for key in self.carried[k]:
            if key[1] == k:
                known[key] = out if key[2] == -1 else out[key[2]]
        return [known[key] for key in self.carried[k]]


def routes_of(split_gm: fx.GraphModule, model_name: str) -> Routes:
    """The routes of a split (`Pipe.split_gm`): each stage is a `call_module` of its top-level
    graph, whose arguments are the model's inputs or (items of) earlier stages' outputs."""
    nodes = list(split_gm.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op == "call_module"]
    stage_of = {n.name: k for k, n in enumerate(calls)}

    def source(arg: Any) -> Key:
        if isinstance(arg, fx.Node) and arg.op == "placeholder":
            return ("root", inputs.index(arg), 0)
        if isinstance(arg, fx.Node) and arg.op == "call_module":
            return ("out", stage_of[arg.name], -1)
        if isinstance(arg, fx.Node) and arg.target is operator.getitem:
            parent, index = arg.args
            if isinstance(parent, fx.Node) and parent.name in stage_of and isinstance(index, int):
                return ("out", stage_of[parent.name], index)
        raise GradmeshError(
            f"model {model_name}: a pipeline stage takes {arg} from its graph, which gradmesh "
            "cannot route between stages (only tensors made by stages or given to the model)"
        )

    for call in calls:
        if call.kwargs:
            raise GradmeshError(
                f"model {model_name}: pipeline stage {stage_of[call.name]} takes keyword "
                "arguments on its graph, which gradmesh cannot route"
            )
    sources = [[source(a) for a in call.args] for call in calls]
    carried = []
    for k in range(len(calls) - 1):
        needed: list[Key] = []
        for later in sources[k + 1 :]:
            needed += [s for s in later if s[0] == "out" and s[1] <= k and s not in needed]
        carried.append(needed)
    return Routes(sources, carried, [str(n.target) for n in inputs])
